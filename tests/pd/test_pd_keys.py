"""The one key function: prefill and decode form the same keys for a prompt, partial block
included, and the full-block keys are the storage tier's own (what match_prefix looks up)."""

from __future__ import annotations

import pytest

from fastdeploy_kvcache.core.hashing import MMItem
from fastdeploy_kvcache.core.request import Request
from fastdeploy_kvcache.engine.pd import KVTransferParams, handoff_keys, parse_kv_transfer_params
from fastdeploy_kvcache.storage.keys import KEY_RE, KeyNamespace

from .helpers import prompt_ids

BS = 16
NS = KeyNamespace(model="m", weights_fingerprint="w", dtype="float32", block_size=BS, layout="L4")


@pytest.mark.parametrize("length", [1, 15, 16, 17, 45, 64, 100])
@pytest.mark.parametrize("extras", [{}, {"cache_salt": "tenant-a"}, {"lora_id": 7},
                                    {"mm_items": (MMItem(offset=3, length=20, mm_hash="img"),)}])
def test_prefill_and_decode_form_the_same_keys(length: int, extras: dict) -> None:
    prompt = prompt_ids(length, length)
    prefill_side = Request("p", prompt, **extras)  # the prompt only
    decode_side = Request("d", prompt, [123], **extras)  # the prompt plus the prefill's first token
    p_keys = handoff_keys(NS, prefill_side)
    d_keys = handoff_keys(NS, decode_side)
    assert p_keys == d_keys
    num_full, n = divmod(length, BS)
    assert p_keys.num_full == num_full and p_keys.partial_tokens == n
    assert p_keys.num_prompt_tokens == length
    # The full keys are exactly the storage tier's (so the decode side's prefix match finds them).
    assert list(p_keys.full) == NS.keys(decode_side.block_hashes(BS)[:num_full])
    if n:
        assert p_keys.partial == f"{NS.prefix}:{prefill_side.partial_block_key(BS)}"
        assert p_keys.partial.endswith(f":partial:{n}")
        assert KEY_RE.match(p_keys.partial)
        # What a decode side that hashed all its tokens (first token included) would form:
        # another key. handoff_keys hashes the prompt only, on both sides.
        naive = decode_side.partial_block_key(BS)
        assert naive is None or f"{NS.prefix}:{naive}" != p_keys.partial
    else:
        assert p_keys.partial is None


def test_keys_differ_with_the_prompt_and_the_namespace() -> None:
    a = handoff_keys(NS, Request("a", prompt_ids(1, 40)))
    b = handoff_keys(NS, Request("b", prompt_ids(1, 39) + [7]))  # last token differs: partial differs
    assert a.full == b.full and a.partial != b.partial
    other = KeyNamespace(model="m", weights_fingerprint="w2", dtype="float32", block_size=BS, layout="L4")
    c = handoff_keys(other, Request("c", prompt_ids(1, 40)))
    assert not set(a.full) & set(c.full) and a.partial != c.partial


@pytest.mark.parametrize("length", [5, 40])
def test_keys_differ_across_salts_partial_block_included(length: int) -> None:
    """A salted hand-off never reads another salt's blocks: every key differs, a prompt
    shorter than one block (its partial block is the first block) too."""
    prompt = prompt_ids(2, length)
    keys = [handoff_keys(NS, Request(f"r{i}", prompt, cache_salt=salt)) for i, salt in enumerate((None, "a", "b"))]
    for i, x in enumerate(keys):
        for y in keys[i + 1:]:
            assert not set(x.full) & set(y.full) and x.partial != y.partial
    assert keys[1] == handoff_keys(NS, Request("again", prompt, [9], cache_salt="a"))


def test_kv_transfer_params_validation_names_the_field() -> None:
    ok = parse_kv_transfer_params({"prefill_token_ids": [5], "request_key": "r", "num_prompt_tokens": 3})
    assert ok == KVTransferParams((5,), "r", 3)
    assert parse_kv_transfer_params(None) is None
    bad = [
        ([1], "must be an object"),
        ({}, "prefill_token_ids: must be a non-empty list"),
        ({"prefill_token_ids": []}, "prefill_token_ids: must be a non-empty list"),
        ({"prefill_token_ids": [-1]}, "prefill_token_ids[0]"),
        ({"prefill_token_ids": [True]}, "prefill_token_ids[0]"),
        ({"prefill_token_ids": [1] * 17}, "at most 16"),
        ({"prefill_token_ids": [1], "request_key": 5}, "request_key"),
        ({"prefill_token_ids": [1], "num_prompt_tokens": 0}, "num_prompt_tokens"),
        ({"prefill_token_ids": [1], "extra": 1}, "unknown field(s) extra"),
    ]
    for raw, words in bad:
        with pytest.raises(ValueError) as info:
            parse_kv_transfer_params(raw)
        assert words in str(info.value) and "kv_transfer_params" in str(info.value)
    with pytest.raises(ValueError, match="num_prompt_tokens must be in"):
        handoff_keys(NS, Request("x", [1, 2, 3]), 4)


def test_a_pd_role_names_everything_it_lacks(monkeypatch: pytest.MonkeyPatch) -> None:
    from fastdeploy_kvcache.engine.args import EngineArgs
    from fastdeploy_kvcache.engine.pd import check_role_config

    monkeypatch.delenv("FD_PD_TRANSFER_VIA_STORAGE", raising=False)
    check_role_config("mixed", None, False)  # mixed needs nothing
    with pytest.raises(ValueError) as info:
        check_role_config("decode", None, False)
    msg = str(info.value)
    assert msg.startswith("--splitwise-role decode needs")
    for part in ("FD_PD_TRANSFER_VIA_STORAGE=1", "ENABLE_V1_KVCACHE_MANAGER=1", "--kvcache-storage-backend"):
        assert part in msg
    monkeypatch.setenv("FD_PD_TRANSFER_VIA_STORAGE", "1")

    class Storage:
        enabled = True

    check_role_config("prefill", Storage(), True)
    with pytest.raises(ValueError, match="splitwise_role: must be one of"):
        check_role_config("both", Storage(), True)
    with pytest.raises(ValueError, match="splitwise_role"):
        EngineArgs(model="tiny-llama-random", splitwise_role="prefil").validate()
