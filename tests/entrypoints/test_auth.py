"""entrypoints/auth.py on its own: the keys file's grammar, the key check, the tenant salt.

The same code behind a real server and router: tests/entrypoints/test_tenants.py and
tests/router/test_tenant_routing.py.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from fastdeploy_kvcache.entrypoints.auth import (MAX_CACHE_SALT_CHARS, ApiKeys, add_auth_cli_args,
                                                 api_keys_from_args, build_api_keys, check_cache_salt,
                                                 load_keys_file, tenant_cache_salt)


@pytest.mark.parametrize("content,keys", [
    ("# comment\n\nk1 alice\n  k2   bob  \nk3 alice\n", {"k1": "alice", "k2": "bob", "k3": "alice"}),
    ('{"k1": "alice", "k2": "bob"}', {"k1": "alice", "k2": "bob"}),
    (' [{"key": "k1", "tenant": "alice"}]', {"k1": "alice"}),
])
def test_a_keys_file_is_json_or_key_tenant_lines(tmp_path: Path, content: str, keys: dict[str, str]) -> None:
    path = tmp_path / "keys"
    path.write_text(content)
    assert load_keys_file(str(path)) == keys


@pytest.mark.parametrize("content,says", [
    ("k1 alice\nk2\n", "line 2: expected '<key> <tenant>', got 1 field(s)"),
    ("k1 alice extra\n", "line 1: expected '<key> <tenant>', got 3 field(s)"),
    ("k1 alice\nk1 bob\n", "line 2: a key appears twice"),
    ('{"k1": 5}', "entry 0: the tenant must be a non-empty string, got 5"),
    ('{"k1": ""}', "entry 0: the tenant must be a non-empty string, got ''"),
    ('{"k1": "al ice"}', "entry 0: the tenant must be printable ASCII without spaces"),
    ('{"k\\u00e9": "alice"}', "entry 0: the key must be printable ASCII without spaces"),
    ('[{"key": "k1"}]', 'entry 0: must be an object with exactly "key" and "tenant"'),
    ('[{"key": "k1", "tenant": "a", "x": 1}]', 'entry 0: must be an object with exactly "key" and "tenant"'),
    ('{"k1": "alice"', "not valid JSON"),
    ('{"k1": "alice", "k1": "bob"}', "not valid JSON (the name 'k1' appears twice in one object"),
    ('[{"key": "k1", "tenant": "a", "key": "k2"}]', "not valid JSON (the name 'key' appears twice"),
    ('[{"key": "k1", "tenant": "a"}, {"key": "k1", "tenant": "b"}]', "entry 1: a key appears twice"),
    ('[1]', 'entry 0: must be an object with exactly "key" and "tenant"'),
    ("# nothing\n", "holds no key"),
    ("", "holds no key"),
])
def test_a_bad_keys_file_is_one_line_naming_the_entry(tmp_path: Path, content: str, says: str) -> None:
    path = tmp_path / "keys"
    path.write_text(content)
    with pytest.raises(ValueError) as exc:
        load_keys_file(str(path))
    assert str(exc.value).startswith(f"--api-keys-file {path}: {says}") and "\n" not in str(exc.value)
    with pytest.raises(ValueError, match="cannot read it"):
        load_keys_file(str(tmp_path / "missing"))


def test_the_key_check_takes_bearer_keys_only_and_names_the_tenant() -> None:
    keys = ApiKeys({"k1": "alice", "k2": None})
    assert keys.check("Bearer k1") == (True, "alice")
    assert keys.check("bearer k1 ") == (True, "alice")
    assert keys.check("Bearer k2") == (True, None)
    for bad in (None, "", "k1", "Basic k1", "Bearer", "Bearer k", "Bearer k1k1", "Bearer K1", "Bearer \udcff"):
        assert keys.check(bad) == (False, None), bad
    assert keys.tenants == {"alice"} and len(keys) == 2


def test_flags_environment_and_isolation_are_checked_together(tmp_path: Path,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    parser = argparse.ArgumentParser()
    add_auth_cli_args(parser)
    path = tmp_path / "keys"
    path.write_text("k1 alice\n")
    monkeypatch.delenv("FDKV_API_KEY", raising=False)
    assert api_keys_from_args(parser.parse_args([])) is None  # no key: no check at all
    monkeypatch.setenv("FDKV_API_KEY", " env-key ")
    assert api_keys_from_args(parser.parse_args([])).check("Bearer env-key") == (True, None)
    keys = api_keys_from_args(parser.parse_args(["--api-key", "flag-key", "--api-keys-file", str(path)]))
    assert keys.check("Bearer env-key") == (False, None)  # the flag wins over the variable
    assert keys.check("Bearer flag-key") == (True, None) and keys.check("Bearer k1") == (True, "alice")
    with pytest.raises(ValueError, match="--api-key: the key is also in --api-keys-file"):
        build_api_keys("k1", str(path))
    with pytest.raises(ValueError, match="--tenant-isolation salt: needs --api-keys-file"):
        api_keys_from_args(parser.parse_args(["--tenant-isolation", "salt"]))
    # An empty --api-key is an error, not an open server; an empty variable means unset.
    with pytest.raises(ValueError, match="^--api-key: the key must be a non-empty string, got ''$"):
        api_keys_from_args(parser.parse_args(["--api-key", ""]))
    monkeypatch.setenv("FDKV_API_KEY", "")
    assert api_keys_from_args(parser.parse_args([])) is None
    with pytest.raises(SystemExit):
        parser.parse_args(["--tenant-isolation", "maybe"])


def test_tenant_salts_never_coincide_and_a_cache_salt_is_a_non_empty_string() -> None:
    pairs = [(t, s) for t in (None, "a", "ab", "a:1") for s in (None, "x", ":x", "1:a:x", "tenant:1:a:")]
    salts = [tenant_cache_salt(t, s) for t, s in pairs]
    assert len(set(salts)) == len(pairs)  # injective: no tenant names another's salt
    assert tenant_cache_salt(None, None) == tenant_cache_salt("", None)  # the tenant-less key's own
    assert check_cache_salt(None) is None and check_cache_salt("s") == "s"
    for bad in ("", 1, b"s", ["s"]):
        with pytest.raises(ValueError, match="^cache_salt: must be a non-empty string"):
            check_cache_salt(bad)
    assert check_cache_salt("s" * MAX_CACHE_SALT_CHARS) == "s" * MAX_CACHE_SALT_CHARS
    with pytest.raises(ValueError, match=f"^cache_salt: at most {MAX_CACHE_SALT_CHARS} characters, got "
                                         f"{MAX_CACHE_SALT_CHARS + 1}$"):
        check_cache_salt("s" * (MAX_CACHE_SALT_CHARS + 1))
