import hashlib
import pickle
import random
import subprocess
import sys
from pathlib import Path

import pytest

from fastdeploy_kvcache.core.hashing import (
    ROOT_HASH,
    BlockHasher,
    MMItem,
    compute_block_hashes,
    hash_block_tokens,
    partial_block_key,
    storage_key,
)

ROOT = Path(__file__).resolve().parents[2]


def test_only_full_blocks_are_hashed():
    assert compute_block_hashes(list(range(7)), 4) == [hash_block_tokens(ROOT_HASH, [0, 1, 2, 3])]
    assert compute_block_hashes(list(range(3)), 4) == []


def test_chained_on_parent():
    a = compute_block_hashes([1, 2, 3, 4, 5, 6, 7, 8], 4)
    b = compute_block_hashes([9, 2, 3, 4, 5, 6, 7, 8], 4)
    assert a[1] != b[1], "same tokens under a different parent must hash differently"
    assert a[1] == hash_block_tokens(a[0], [5, 6, 7, 8])


def test_incremental_equals_one_shot():
    toks = list(range(1000, 1103))
    h = BlockHasher(8)
    for n in (0, 5, 8, 9, 40, 103):
        h.extend(toks, n)
    assert h.hashes == compute_block_hashes(toks, 8)


def test_extra_keys_change_hash():
    toks = list(range(16))
    base = compute_block_hashes(toks, 4)
    assert compute_block_hashes(toks, 4, lora_id=3) != base
    salted = compute_block_hashes(toks, 4, cache_salt="tenant-a")
    assert all(x != y for x, y in zip(salted, base)), "salt on block 0 must propagate down the chain"
    mm = compute_block_hashes(toks, 4, mm_items=[MMItem(5, 4, "img-1")])
    # blocks 1 and 2 overlap tokens 5..8; block 0 does not
    assert mm[0] == base[0] and mm[1] != base[1] and mm[2] != base[2]
    mm2 = compute_block_hashes(toks, 4, mm_items=[MMItem(5, 4, "img-2")])
    assert mm2[1] != mm[1]
    # an item ending exactly at a block start does not touch that block
    edge = compute_block_hashes(toks, 4, mm_items=[MMItem(0, 4, "img")])
    assert edge[0] != base[0] and edge[1] != base[1]  # block 1 differs only through the chain
    assert edge[1] == hash_block_tokens(edge[0], toks[4:8])


def test_partial_key_form():
    h = BlockHasher(4)
    toks = list(range(10))
    key = h.partial_key(toks)
    full = compute_block_hashes(toks, 4)
    assert key == partial_block_key(hash_block_tokens(full[-1], [8, 9]), 2)
    assert key.endswith(":partial:2") and len(key.split(":")[0]) == 32
    assert h.partial_key(list(range(8))) is None
    assert storage_key(full[0]) == format(full[0], "032x")
    with pytest.raises(ValueError):
        partial_block_key(1, 0)


def test_deterministic_across_processes():
    code = (
        "from fastdeploy_kvcache.core.hashing import compute_block_hashes, MMItem\n"
        "print(compute_block_hashes(list(range(64)), 16, mm_items=[MMItem(3, 20, 'x')], lora_id=7, cache_salt='s'))"
    )
    runs = {
        subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True,
                       env={"PYTHONHASHSEED": seed, "PATH": ""}).stdout
        for seed in ("1", "2")
    }
    assert len(runs) == 1
    here = compute_block_hashes(list(range(64)), 16, mm_items=[MMItem(3, 20, "x")], lora_id=7, cache_salt="s")
    assert runs.pop().strip() == str(here)


def test_no_pickle_in_hash_path(monkeypatch):
    monkeypatch.setattr(pickle, "dumps", lambda *a, **k: pytest.fail("pickle used for hashing"))
    monkeypatch.setattr(hashlib, "sha256", lambda *a, **k: pytest.fail("sha256 used for hashing"))
    compute_block_hashes(list(range(256)), 16, lora_id=1)


def test_bad_inputs():
    with pytest.raises(ValueError):
        BlockHasher(0)
    with pytest.raises(ValueError):
        BlockHasher(4, mm_items=[MMItem(-1, 3, "x")])


def test_a_salted_chain_is_the_definition_block_by_block_and_incrementally() -> None:
    """The salt enters block 0 only; the hasher's fast path for it (no other extra key) gives
    the hashes of the definition, whole or extended piece by piece."""
    from fastdeploy_kvcache.core.hashing import ROOT_HASH, BlockHasher, hash_block_tokens

    rng = random.Random(5)
    for n in (5, 16, 33, 100):
        ids = [rng.randrange(1000) for _ in range(n)]
        ref, parent = [], ROOT_HASH
        for i in range(n // 16):
            parent = hash_block_tokens(parent, ids[i * 16:(i + 1) * 16], cache_salt="s" if i == 0 else None)
            ref.append(parent)
        hasher = BlockHasher(16, cache_salt="s")
        hasher.extend(ids[:20])
        assert hasher.extend(ids) == ref == compute_block_hashes(ids, 16, cache_salt="s"), n
        if ref:
            assert ref[0] != compute_block_hashes(ids, 16)[0]
