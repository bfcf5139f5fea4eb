"""API keys, tenants and the tenant's cache salt: shared by the server and the router.

``--api-key KEY`` (or ``FDKV_API_KEY``) and ``--api-keys-file PATH`` turn authentication on:
every ``/v1`` route (and ``/debug``) then needs ``Authorization: Bearer <key>`` and answers
401 otherwise.
``/health`` and ``/metrics`` stay open (load balancers and Prometheus scrape them without a
key; neither shows a prompt).  The keys file names each key's tenant; ``--tenant-isolation
salt`` then salts every request by its tenant, so no two tenants ever share a cached block
(:func:`tenant_cache_salt`).

Keys file: either JSON (an object ``{"<key>": "<tenant>", ...}`` or a list of
``{"key": ..., "tenant": ...}``) or text, one ``<key> <tenant>`` per line (blank lines and
lines starting with ``#`` are skipped).  Keys and tenant names are printable ASCII without
spaces; a key appears once.
"""

from __future__ import annotations

import argparse
import hashlib
import hmac
import json
import os
from dataclasses import dataclass
from typing import Any, Awaitable, Callable, Mapping, Optional

from fastdeploy_kvcache.cli_flags import add_flag

TENANT_ISOLATION_MODES: tuple[str, ...] = ("none", "salt", "k-anonymity", "salt-after-system")
"""``--tenant-isolation`` choices (docs/security.md): ``none`` (tenants share cached prefixes; a
request's own ``cache_salt`` still separates it), ``salt`` (every request is salted by its
tenant), ``k-anonymity`` (a block is shared across tenants once ``--k-anonymity-k`` distinct
tenants computed it: core/k_anonymity.py) and ``salt-after-system`` (a chat's leading system
messages are shared unsalted, the rest is salted by the tenant)."""

# The modes that salt by the tenant (from the first block, or after the system messages).
TENANT_SALTED_MODES: frozenset[str] = frozenset({"salt", "salt-after-system"})

DEFAULT_K_ANONYMITY_K = 2

API_KEY_ENV = "FDKV_API_KEY"
"""The environment variable ``--api-key`` defaults to (``envs.py``)."""

MAX_NAME_CHARS = 256
MAX_CACHE_SALT_CHARS = 1024
"""Longest ``cache_salt`` accepted.  A salt names a namespace (a random token, a project id);
a longer one is a mistake or an attempt to make every server and the router hold and hash
megabytes per request, so it is a 400 rather than silently accepted."""
_BEARER = "bearer "


def _check_name(what: str, value: Any, where: str) -> str:
    """A key or tenant name: a non-empty string of printable ASCII without spaces."""
    if not isinstance(value, str) or not value:
        raise ValueError(f"{where}: the {what} must be a non-empty string, got {value!r}")
    if len(value) > MAX_NAME_CHARS:
        raise ValueError(f"{where}: the {what} is longer than {MAX_NAME_CHARS} characters")
    if not all("!" <= c <= "~" for c in value):
        raise ValueError(f"{where}: the {what} must be printable ASCII without spaces")
    return value


def _no_repeated_names(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """``json.loads``' object hook: a name given twice in one object is an error (json keeps the
    last one silently, which would drop a key, or change its tenant, without a word)."""
    out: dict[str, Any] = {}
    for name, value in pairs:
        if name in out:
            raise ValueError(f"the name {name!r} appears twice in one object")
        out[name] = value
    return out


def load_keys_file(path: str) -> dict[str, str]:
    """``{key: tenant}`` from a keys file; ValueError (one line naming the file and the entry)."""
    flag = f"--api-keys-file {path}"
    try:
        with open(os.path.expanduser(path), "r", encoding="utf-8") as f:
            text = f.read()
    except (OSError, UnicodeDecodeError) as exc:
        raise ValueError(f"{flag}: cannot read it ({getattr(exc, 'strerror', None) or exc})") from None
    pairs: list[tuple[str, Any, str]] = []
    if text.lstrip()[:1] in ("{", "["):
        try:
            data = json.loads(text, object_pairs_hook=_no_repeated_names)
        except ValueError as exc:
            raise ValueError(f"{flag}: not valid JSON ({exc})") from None
        if isinstance(data, dict):
            pairs = [(k, v, f"{flag}: entry {i}") for i, (k, v) in enumerate(data.items())]
        else:
            for i, entry in enumerate(data):
                where = f"{flag}: entry {i}"
                if not isinstance(entry, dict) or set(entry) != {"key", "tenant"}:
                    raise ValueError(f"{where}: must be an object with exactly \"key\" and \"tenant\"")
                pairs.append((entry["key"], entry["tenant"], where))
    else:
        for n, line in enumerate(text.splitlines(), 1):
            stripped = line.strip()
            if not stripped or stripped.startswith("#"):
                continue
            fields = stripped.split()
            if len(fields) != 2:
                raise ValueError(f"{flag}: line {n}: expected '<key> <tenant>', got {len(fields)} field(s)")
            pairs.append((fields[0], fields[1], f"{flag}: line {n}"))
    keys: dict[str, str] = {}
    for key, tenant, where in pairs:
        _check_name("key", key, where)
        _check_name("tenant", tenant, where)
        if key in keys:
            raise ValueError(f"{where}: a key appears twice")
        keys[key] = tenant
    if not keys:
        raise ValueError(f"{flag}: holds no key")
    return keys


class ApiKeys:
    """The keys a server or router accepts, each with its tenant (None: ``--api-key``'s key).

    NOTE: the presented key is looked up by its SHA-256 digest, and the entry found is
    compared with ``hmac.compare_digest``: a lookup's time then depends on the digest, which
    tells an attacker nothing about any key, rather than on how many leading characters of a
    key they guessed.  One hash per request (~0.3 us) is the whole cost.
    """

    def __init__(self, keys: Mapping[str, Optional[str]]) -> None:
        if not keys:
            raise ValueError("ApiKeys: no key given")
        self._by_digest: dict[bytes, tuple[bytes, Optional[str]]] = {}
        for key, tenant in keys.items():
            raw = key.encode("utf-8")
            self._by_digest[hashlib.sha256(raw).digest()] = (raw, tenant)
        self.tenants = frozenset(t for t in keys.values() if t is not None)

    def __len__(self) -> int:
        return len(self._by_digest)

    def check(self, authorization: Optional[str]) -> tuple[bool, Optional[str]]:
        """``(accepted, tenant)`` for an ``Authorization`` header value (None: no header)."""
        if not authorization or authorization[:7].lower() != _BEARER:
            return False, None
        raw = authorization[7:].strip().encode("utf-8", "surrogateescape")
        found = self._by_digest.get(hashlib.sha256(raw).digest())
        if found is None or not hmac.compare_digest(found[0], raw):
            return False, None
        return True, found[1]

    def any_key(self) -> str:
        """One accepted key (a router's own calls to its workers)."""
        return next(iter(self._by_digest.values()))[0].decode("utf-8")


def build_api_keys(api_key: Optional[str], keys_file: Optional[str]) -> Optional[ApiKeys]:
    """The keys of ``--api-key`` and ``--api-keys-file``; None when neither is given (no auth).

    ValueError, one line naming the flag, for a bad file or a key given twice.
    """
    keys: dict[str, Optional[str]] = {}
    if keys_file:
        keys.update(load_keys_file(keys_file))
    if api_key is not None:
        # An empty --api-key is refused, not taken as "no key": the server would otherwise
        # start open while its operator believes it checks keys.
        _check_name("key", api_key, "--api-key")
        if api_key in keys:
            raise ValueError(f"--api-key: the key is also in --api-keys-file {keys_file} (give it once)")
        keys[api_key] = None
    return ApiKeys(keys) if keys else None


def check_isolation(mode: str, keys: Optional[ApiKeys]) -> None:
    """ValueError when ``--tenant-isolation`` cannot work with the keys given."""
    if mode not in TENANT_ISOLATION_MODES:
        raise ValueError(f"--tenant-isolation: must be one of {', '.join(TENANT_ISOLATION_MODES)}, got {mode!r}")
    if mode != "none" and (keys is None or not keys.tenants):
        raise ValueError(f"--tenant-isolation {mode}: needs --api-keys-file (it names each key's tenant)")


def tenant_cache_salt(tenant: Optional[str], cache_salt: Optional[str]) -> Optional[str]:
    """The salt a request of ``tenant`` is hashed with under ``--tenant-isolation salt``.

    ``tenant:<len>:<tenant>:`` followed by the request's own ``cache_salt`` (if any): the
    length prefix makes the pair recoverable from the result, so two different (tenant, salt)
    pairs never give one salt, and a tenant cannot name another tenant's salt with any
    ``cache_salt`` of its own.  A key without a tenant (``--api-key``'s) counts as the tenant
    with the empty name, which no keys file can name: it cannot reach a tenant's blocks
    either.  Deterministic (no secret), so servers that share a store, and the router,
    derive the same salt.
    """
    name = tenant or ""
    return f"tenant:{len(name)}:{name}:{cache_salt or ''}"


def system_prefix_tokens(full: list[int], system_only: list[int]) -> int:
    """Where the shared part of a chat prompt ends under ``--tenant-isolation
    salt-after-system``: the tokens ``full`` (every message rendered) has in common with
    ``system_only`` (the leading system messages rendered alone), from the start.

    The common prefix rather than ``len(system_only)``: a template may render the last
    system message differently when nothing follows it, and only tokens that are the same in
    both are the system part of the full prompt.
    """
    n = min(len(full), len(system_only))
    i = 0
    while i < n and full[i] == system_only[i]:
        i += 1
    return i


def check_cache_salt(value: Any) -> Optional[str]:
    """A request's ``cache_salt``: None, or a non-empty string of at most
    :data:`MAX_CACHE_SALT_CHARS` characters; ValueError naming the field."""
    if value is None:
        return None
    if not isinstance(value, str):
        raise ValueError(f"cache_salt: must be a non-empty string, got {type(value).__name__}")
    if not value:
        raise ValueError("cache_salt: must be a non-empty string, got an empty one")
    if len(value) > MAX_CACHE_SALT_CHARS:
        raise ValueError(f"cache_salt: at most {MAX_CACHE_SALT_CHARS} characters, got {len(value)}")
    return value


# ---------------------------------------------------------------------- flags
def add_auth_cli_args(parser: argparse.ArgumentParser) -> None:
    """``--api-key``, ``--api-keys-file``, ``--tenant-isolation``: the server's and the router's."""
    group = parser.add_argument_group("API keys and tenants (docs/usage.md, \"API keys and cache isolation\")")

    def add(flag: str, **kwargs: Any) -> None:
        add_flag(group, flag, **kwargs)

    add("--api-key", dest="api_key", default=None, metavar="KEY",
        help=f"Every /v1 route, and the endpoints that list block hashes (/debug/kv_cache_blocks, "
             f"/router/state), then need 'Authorization: Bearer KEY' and answer 401 without it; /health and "
             f"/metrics stay open. An empty KEY is an error (default: ${API_KEY_ENV} if set and not "
             f"empty, else no key).")
    add("--api-keys-file", dest="api_keys_file", default=None, metavar="PATH",
        help="Keys and their tenants: JSON ({\"KEY\": \"TENANT\", ...}) or one 'KEY TENANT' per line; "
             "accepted as --api-key's is. A bad file ends start-up with one line naming the entry (default: none).")
    add("--tenant-isolation", dest="tenant_isolation", default="none", choices=TENANT_ISOLATION_MODES,
        help="none: tenants share cached prefixes (a request's own cache_salt still separates it); salt: "
             "every request is salted by its key's tenant (with its cache_salt, if any), so no cached block "
             "is shared between tenants on any tier; k-anonymity: a cached block is reused by other tenants "
             "only once --k-anonymity-k distinct tenants computed it (until then it is a miss for them on "
             "every tier); salt-after-system: a chat's leading system messages are shared, the rest is "
             "salted by the tenant (completions: all of it). Every mode but none needs --api-keys-file "
             "(docs/security.md; default: none).")
    add("--k-anonymity-k", dest="k_anonymity_k", type=_k_at_least_2, default=None, metavar="K",
        help=f"Distinct tenants that must have computed a cached block before --tenant-isolation k-anonymity "
             f"shares it with the others (>= 2; default: {DEFAULT_K_ANONYMITY_K}).")


def _k_at_least_2(text: str) -> int:
    """argparse ``type=`` of ``--k-anonymity-k``: an integer >= 2 (1 would share everything)."""
    try:
        value = int(text, 10)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer >= 2, got {text!r}") from None
    if value < 2:
        raise argparse.ArgumentTypeError(f"expected an integer >= 2, got {text!r}")
    return value


def k_anonymity_k_of(args: argparse.Namespace) -> int:
    """The cache's ``k_anonymity_k`` the flags ask for: ``--k-anonymity-k`` under
    ``--tenant-isolation k-anonymity``, else 0 (off)."""
    if getattr(args, "tenant_isolation", "none") != "k-anonymity":
        return 0
    return int(getattr(args, "k_anonymity_k", None) or DEFAULT_K_ANONYMITY_K)


def api_keys_from_args(args: argparse.Namespace) -> Optional[ApiKeys]:
    """The keys the flags (and ``FDKV_API_KEY``) name, checked against ``--tenant-isolation``;
    ValueError with one line naming the flag."""
    from fastdeploy_kvcache import envs

    api_key = getattr(args, "api_key", None)
    if api_key is None:
        api_key = envs.api_key()
    keys = build_api_keys(api_key, getattr(args, "api_keys_file", None))
    mode = getattr(args, "tenant_isolation", "none")
    check_isolation(mode, keys)
    if getattr(args, "k_anonymity_k", None) is not None and mode != "k-anonymity":
        raise ValueError(f"--k-anonymity-k: only with --tenant-isolation k-anonymity (got {mode})")
    return keys


# ---------------------------------------------------------------------- ASGI guard
UNAUTHORIZED_BODY = json.dumps({"error": {
    "message": "invalid or missing API key: send 'Authorization: Bearer <key>'",
    "type": "invalid_request_error", "param": None, "code": "invalid_api_key"}}).encode()

TENANT_STATE = "fdkv_tenant"
"""Key of ``scope["state"]`` (``request.state.fdkv_tenant``) that holds the caller's tenant."""


def authorization_of(scope: Mapping[str, Any]) -> Optional[str]:
    """The request's ``Authorization`` header, or None."""
    for name, value in scope.get("headers", ()):
        if name == b"authorization" or name.lower() == b"authorization":
            return value.decode("latin-1")
    return None


def tenant_of_scope(scope: Mapping[str, Any]) -> Optional[str]:
    """The tenant :class:`ApiKeyGuard` found for this request (None: no keys, or no tenant)."""
    state = scope.get("state")
    return state.get(TENANT_STATE) if isinstance(state, dict) else None


GUARDED_PREFIXES = ("/v1/", "/debug/", "/router/")
"""Paths that need a key: the API, the server's ``/debug/kv_cache_blocks`` and the router's
``/router/state`` (both list cached blocks' hashes, from which a client could test whether a
prompt is cached)."""


class ApiKeyGuard:
    """ASGI middleware: requests under :data:`GUARDED_PREFIXES` without an accepted key get
    401; everything else (``/health``, ``/metrics``) passes.

    The accepted key's tenant goes to ``scope["state"]`` (:func:`tenant_of_scope`).  Only
    installed when keys are configured, so a server without keys pays nothing.
    """

    def __init__(self, app: Callable[..., Awaitable[None]], keys: ApiKeys) -> None:
        self.app = app
        self.keys = keys

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "http" and scope["path"].startswith(GUARDED_PREFIXES):
            ok, tenant = self.keys.check(authorization_of(scope))
            if not ok:
                await send({"type": "http.response.start", "status": 401, "headers": [
                    (b"content-type", b"application/json"), (b"www-authenticate", b"Bearer"),
                    (b"content-length", str(len(UNAUTHORIZED_BODY)).encode())]})
                await send({"type": "http.response.body", "body": UNAUTHORIZED_BODY})
                return
            state = scope.get("state")
            if not isinstance(state, dict):
                state = scope["state"] = {}
            state[TENANT_STATE] = tenant
        await self.app(scope, receive, send)


@dataclass(frozen=True)
class Caller:
    """Who sent a proxied request: its ``Authorization`` header (forwarded) and tenant."""

    authorization: Optional[str] = None
    tenant: Optional[str] = None

    @classmethod
    def of_scope(cls, scope: Mapping[str, Any]) -> "Caller":
        return cls(authorization_of(scope), tenant_of_scope(scope))
