import pytest

from fastdeploy_kvcache.config import CacheConfig
from fastdeploy_kvcache.core.block_pool import NoFreeBlocksError
from fastdeploy_kvcache.core.cache_manager import CacheManager, CacheManagerError, UnknownRequestError
from fastdeploy_kvcache.core.metadata import CacheLevel, CacheSwapMetadata, NodeState, TransferKind
from fastdeploy_kvcache.core.request import BatchRequest, Request

from ._shadow import ShadowMemory

BS = 4


def make(policy="write_back", dev=16, host=16, **kw):
    cfg = CacheConfig(block_size=BS, num_gpu_blocks=dev, num_host_blocks=host, write_policy=policy, **kw)
    mgr = CacheManager(cfg)
    return mgr, ShadowMemory(dev, host, BS)


def blocks_for(req):
    return -(-req.num_total_tokens // BS)


def admit(mgr, req):
    """match + allocate what the whole request needs; returns the MatchResult."""
    m = mgr.match_prefix(req)
    mgr.allocate_device_blocks(req, blocks_for(req) - m.num_device_blocks)
    return m


def step(mgr, shadow, reqs, evict_ok=True, swap_ok=True, complete=True):
    batch = BatchRequest(reqs)
    batch.append_evict_metadata(mgr.issue_pending_backup_to_batch_request())
    done = shadow.run_step(batch, evict_ok, swap_ok)
    affected = []
    if complete:
        for meta in done:
            affected += mgr.complete_swap(meta)
    mgr.check_invariants()
    return batch, done, affected


def cache_prompt(mgr, shadow, request_id, token_ids):
    """Run a request through one step and finish it, so its full blocks are cached."""
    req = Request(request_id, token_ids)
    admit(mgr, req)
    step(mgr, shadow, [req])
    mgr.request_finish(req)
    return req


def push_prompt_to_host():
    """write_back, 4 device blocks: prompt range(13) (3 full blocks) cached, then written
    back to host by a second 15-token prompt that needs every device block."""
    mgr, sh = make("write_back", dev=4, host=8)
    cache_prompt(mgr, sh, "a", list(range(13)))
    cache_prompt(mgr, sh, "b", list(range(100, 115)))
    return mgr, sh


def snapshot(mgr):
    return (mgr.check_invariants(), {k: v for k, v in mgr.get_stats().items()})


def test_match_leaves_last_token():
    mgr, sh = make()
    cache_prompt(mgr, sh, "a", list(range(8)))  # exactly two blocks
    b = Request("b", list(range(8)))
    m = mgr.match_prefix(b)
    assert m.num_matched_blocks == 1 and m.num_matched_tokens == 4
    c = Request("c", list(range(9)))
    assert mgr.match_prefix(c).num_matched_tokens == 8


def test_device_hits_are_shared_and_duplicates_freed():
    mgr, sh = make()
    cache_prompt(mgr, sh, "a", list(range(10)))
    b, c = Request("b", list(range(12)) + [99]), Request("c", list(range(8)) + [5, 5])
    admit(mgr, b)
    admit(mgr, c)
    assert b.block_tables[:2] == c.block_tables[:2]
    assert b.num_cached_tokens == 8 and c.num_cached_tokens == 8
    node = b.match_result.nodes[0]
    assert node.ref_count == 2
    step(mgr, sh, [b, c])
    sh.check_request(b)
    sh.check_request(c)
    # d computes blocks 0-1 itself while nothing is cached yet for it -> duplicates on finish
    d = Request("d", list(range(10)))
    mgr.allocate_device_blocks(d, 3)  # no match_prefix: no reuse
    step(mgr, sh, [d])
    free_before = mgr.device_pool.num_free
    mgr.request_finish(d)
    assert mgr.device_pool.num_free == free_before + 3  # 2 duplicates + the partial block
    assert mgr.get_stats()["duplicate_blocks"] == 2
    mgr.request_finish(b)
    mgr.request_finish(c)
    assert node.ref_count == 0
    mgr.check_invariants()


def test_write_back_evicts_then_swaps_in():
    mgr, sh = make("write_back", dev=4, host=8)
    cache_prompt(mgr, sh, "a", list(range(13)))  # 3 full blocks + 1 token; 3 cached device blocks, 1 free
    b = Request("b", list(range(100, 115)))  # needs 4 blocks -> evict 3
    admit(mgr, b)
    evict = b.cache_evict_metadata[0]
    assert evict.kind is TransferKind.EVICT and len(evict) == 3
    assert (evict.src_type, evict.dst_type) == (CacheLevel.DEVICE, CacheLevel.HOST)
    nodes = list(mgr.tree.iter_nodes())
    assert {n.state for n in nodes if n.host_block_id is not None} == {NodeState.SWAP_TO_HOST}
    # in flight: not matchable from host yet
    assert mgr.match_prefix(Request("x", list(range(13)))).num_matched_blocks == 0
    _, done, _ = step(mgr, sh, [b], complete=False)
    for meta in done:
        mgr.complete_swap(meta)
    assert {n.state for n in nodes if n.host_block_id is not None} == {NodeState.HOST}
    mgr.request_finish(b)
    c = Request("c", list(range(13)) + [7])
    m = mgr.match_prefix(c)
    assert (m.num_device_blocks, m.num_host_blocks) == (0, 3)
    mgr.allocate_device_blocks(c, 4)
    swap = c.cache_swap_metadata[0]
    assert swap.src_block_ids == m.host_block_ids and swap.dst_block_ids == c.block_tables[:3]
    assert swap.dst_block_ids == sorted(swap.dst_block_ids)
    assert c.num_cached_tokens == 12
    step(mgr, sh, [c])
    sh.check_request(c)
    # write_back is exclusive: host copies released once the loads are confirmed
    assert all(n.host_block_id is None for n in c.match_result.nodes)
    assert mgr.get_stats()["swap_in_blocks"] == 3


def test_failed_swap_in_reports_affected_requests():
    mgr, sh = push_prompt_to_host()
    c = Request("c", list(range(13)) + [7])
    admit(mgr, c)
    assert c.num_cached_tokens == 12
    _, done, affected = step(mgr, sh, [c], swap_ok=False)
    assert affected == ["c"]
    assert c.num_cached_tokens == 0 and c.num_computed_tokens == 0
    # the host copies are still there and matchable
    assert mgr.match_prefix(Request("y", list(range(13)))).num_host_blocks == 3
    step(mgr, sh, [c])  # recompute
    sh.check_request(c)
    mgr.request_finish(c)  # donates its recomputed blocks to the host-only nodes
    m = mgr.match_prefix(Request("z", list(range(13))))
    assert m.num_device_blocks == 3
    assert mgr.get_stats()["failed_blocks"] == 3


def test_failed_write_back_eviction_drops_the_block():
    mgr, sh = make("write_back", dev=4, host=8)
    cache_prompt(mgr, sh, "a", list(range(13)))
    b = Request("b", list(range(100, 115)))
    admit(mgr, b)
    step(mgr, sh, [b], evict_ok=False)
    assert mgr.tree.num_nodes == 0 and mgr.host_pool.num_free == 8
    assert mgr.match_prefix(Request("x", list(range(13)))).num_matched_blocks == 0


def test_write_through_backup_in_flight_until_confirmed():
    mgr, sh = make("write_through", dev=4, host=8)
    cache_prompt(mgr, sh, "a", list(range(9)))
    meta = mgr.issue_pending_backup_to_batch_request()
    assert meta.kind is TransferKind.BACKUP and len(meta) == 2
    assert mgr.issue_pending_backup_to_batch_request() is None  # issued once
    nodes = list(mgr.tree.iter_nodes())
    assert all(n.state is NodeState.BACKUP_TO_HOST for n in nodes)
    # device copies of in-flight nodes cannot be evicted: only 2 blocks are available
    assert not mgr.can_allocate_device_blocks(5)
    with pytest.raises(NoFreeBlocksError):
        mgr.allocate_device_blocks(Request("big", list(range(50, 65))), 4)
    mgr.check_invariants()
    sh.copy(meta, True)
    mgr.complete_swap(meta)
    assert all(n.state is NodeState.DEVICE_AND_HOST for n in nodes)
    b = Request("b", list(range(50, 65)))
    admit(mgr, b)  # evicts by dropping device copies: no copy needed
    assert b.cache_evict_metadata == []
    assert all(n.state is NodeState.HOST for n in nodes)
    step(mgr, sh, [b])


def test_failed_backup_leaves_device_copy():
    mgr, sh = make("write_through", dev=4, host=8)
    cache_prompt(mgr, sh, "a", list(range(9)))
    meta = mgr.issue_pending_backup_to_batch_request()
    sh.copy(meta, False)
    assert mgr.complete_swap(meta) == []
    assert all(n.state is NodeState.DEVICE for n in mgr.tree.iter_nodes())
    assert mgr.host_pool.num_free == 8


def test_selective_threshold():
    mgr, sh = make("write_through_selective", write_through_threshold=2)
    cache_prompt(mgr, sh, "a", list(range(9)))
    for i in range(2):
        assert mgr.issue_pending_backup_to_batch_request() is None
        r = Request(f"r{i}", list(range(9)) + [i])
        admit(mgr, r)
        step(mgr, sh, [r])
        mgr.request_finish(r)
    # the second hit crossed the threshold; step() above already issued and completed it
    assert mgr.get_stats()["backup_blocks"] == 2


def test_interior_nodes_are_never_evicted():
    mgr, sh = make("write_through", dev=6, host=0)
    cache_prompt(mgr, sh, "a", list(range(17)))  # 4 full blocks + 1
    b = Request("b", list(range(100, 103)))
    mgr.allocate_device_blocks(b, 4)  # 2 free + needs 2 evictions: the two deepest
    depths = sorted(n.depth for n in mgr.tree.iter_nodes())
    assert depths == [0, 1]
    mgr.check_invariants()


def test_preempt_keeps_cache_and_resets_request():
    mgr, sh = make()
    a = Request("a", list(range(10)))
    admit(mgr, a)
    step(mgr, sh, [a])
    a.output_token_ids += [1, 2, 3]
    mgr.allocate_device_blocks(a, 1)
    step(mgr, sh, [a])
    mgr.preempt_request(a)
    assert a.block_tables == [] and a.num_cached_tokens == 0 and a.num_computed_tokens == 0
    m = mgr.match_prefix(a)
    assert m.num_matched_tokens == 12  # 13 tokens: 3 full blocks, the last token left to compute
    admit_blocks = blocks_for(a) - m.num_device_blocks
    mgr.allocate_device_blocks(a, admit_blocks)
    step(mgr, sh, [a])
    sh.check_request(a)


def test_unissued_swap_in_is_cancelled_on_preempt():
    mgr, sh = push_prompt_to_host()
    c = Request("c", list(range(13)) + [1])
    admit(mgr, c)
    # 3 loads for c, and b's 3 blocks being written back to make room
    assert c.cache_swap_metadata and mgr.num_copies_in_flight == 6
    mgr.preempt_request(c)  # never batched: its loads are taken back, the evictions are kept
    assert mgr.num_copies_in_flight == 3
    mgr.check_invariants()
    evict = mgr.issue_pending_backup_to_batch_request()
    assert evict.kind is TransferKind.EVICT and len(evict) == 3
    sh.copy(evict, True)
    mgr.complete_swap(evict)
    assert mgr.match_prefix(Request("d", list(range(13)))).num_host_blocks == 3


def test_no_free_blocks_leaves_request_unchanged():
    mgr, sh = make(dev=4, host=0)
    a = Request("a", list(range(13)))
    admit(mgr, a)
    b = Request("b", list(range(100, 110)))
    assert not mgr.can_allocate_device_blocks(3)
    with pytest.raises(NoFreeBlocksError):
        mgr.allocate_device_blocks(b, 3)
    assert b.block_tables == [] and not mgr.is_running("b")
    mgr.check_invariants()



def test_no_free_blocks_keeps_a_request_that_holds_no_blocks_yet_running():
    """A request registered by a zero-block allocation stays registered when a later one fails."""
    mgr, _ = make(dev=4, host=4)
    a = Request("a", list(range(6)))
    mgr.match_prefix(a)
    assert mgr.allocate_device_blocks(a, 0) == [] and mgr.is_running("a")
    before = snapshot(mgr)
    with pytest.raises(NoFreeBlocksError):
        mgr.allocate_device_blocks(a, 5)
    assert mgr.is_running("a") and a.block_tables == []
    assert snapshot(mgr) == before
    mgr.allocate_device_blocks(a, 2)
    mgr.request_finish(a)  # still known to the manager
    mgr.check_invariants()

def test_bad_input_raises_and_changes_nothing():
    mgr, sh = make()
    a = Request("a", list(range(10)))
    admit(mgr, a)
    step(mgr, sh, [a])
    before = snapshot(mgr)
    with pytest.raises(UnknownRequestError):
        mgr.request_finish(Request("ghost", [1, 2, 3]))
    with pytest.raises(CacheManagerError):
        mgr.allocate_device_blocks(a, -1)
    with pytest.raises(CacheManagerError):
        mgr.allocate_device_blocks(Request("a", [1]), 1)  # another object, same id
    with pytest.raises(CacheManagerError):
        mgr.match_prefix(a)  # already running
    with pytest.raises(CacheManagerError):
        mgr.request_finish("a")
    a.block_tables.append(15)  # an id a does not own
    with pytest.raises(CacheManagerError, match="not owned"):
        mgr.request_finish(a)
    a.block_tables.pop()
    foreign = CacheSwapMetadata([0], [3], CacheLevel.HOST, CacheLevel.DEVICE, [123])
    foreign.mark_done(True)
    with pytest.raises(CacheManagerError, match="not a copy in flight"):
        mgr.complete_swap(foreign)
    with pytest.raises(CacheManagerError):
        mgr.reset_cache()  # a is running
    assert snapshot(mgr) == before
    mgr.request_finish(a)
    with pytest.raises(UnknownRequestError, match="already finished"):
        mgr.request_finish(a)



def _complete_split(mgr, meta, fail_dsts):
    """Deliver ``meta`` as two parts: the blocks going to ``fail_dsts`` failed, the rest landed."""
    affected = []
    for ok in (True, False):
        idx = [i for i, d in enumerate(meta.dst_block_ids) if (d in fail_dsts) != ok]
        if idx:
            part = CacheSwapMetadata(
                [meta.src_block_ids[i] for i in idx], [meta.dst_block_ids[i] for i in idx],
                meta.src_type, meta.dst_type, [meta.hash_values[i] for i in idx],
            )
            part.mark_done(ok, None if ok else "injected")
            affected += mgr.complete_swap(part)
    return affected


def test_recompute_after_a_failed_load_never_writes_a_block_a_backup_reads():
    """A request recomputing after a failed load gets private blocks, also for a shared block under backup."""
    mgr, sh = make("write_through_selective", dev=10, host=3, write_through_threshold=1)
    prompt = list(range(13))  # blocks N0 N1 N2 + 1 token
    a = cache_prompt(mgr, sh, "a", prompt)
    n0 = mgr.tree.root.children[a.block_hashes(BS)[0]]
    n1 = n0.children[a.block_hashes(BS)[1]]
    n2 = n1.children[a.block_hashes(BS)[2]]
    cache_prompt(mgr, sh, "b", prompt)  # a hit: all three get backed up
    cache_prompt(mgr, sh, "x", list(range(100, 100 + 10 * BS)))  # pushes N0-N2 off the device
    assert [n.state for n in (n0, n1, n2)] == [NodeState.HOST] * 3
    # l loads all three; N1's load fails, N2's lands: N1 is host-only under a device N2
    l = Request("l", prompt)
    admit(mgr, l)
    _, done, _ = step(mgr, sh, [l], complete=False)
    (swap,) = [m for m in done if m.dst_type is CacheLevel.DEVICE]
    assert _complete_split(mgr, swap, {n1.device_block_id}) == ["l"]
    step(mgr, sh, [l])
    for rid in ("y1", "y2"):  # y2's hit backs up y1's block, which takes N2's host copy
        y = Request(rid, [200] * 5)
        admit(mgr, y)
        step(mgr, sh, [y])
        mgr.request_finish(y)
    assert [n.state for n in (n0, n1, n2)] == [NodeState.DEVICE_AND_HOST, NodeState.HOST, NodeState.DEVICE]
    # r matches N0 (device), N1 (host), N2 (device): N2 is backed up in the step that loads N1
    r = Request("r", prompt)
    admit(mgr, r)
    assert r.block_tables[2] == n2.device_block_id
    _, done, _ = step(mgr, sh, [r], swap_ok=False, complete=False)
    assert n2.state is NodeState.BACKUP_TO_HOST
    (swap,) = [m for m in done if m.dst_type is CacheLevel.DEVICE]
    assert mgr.complete_swap(swap) == ["r"]  # the backup of N2 is still in flight
    assert r.num_computed_tokens == BS  # r recomputes blocks 1 and 2 in its next step
    assert r.block_tables[2] != n2.device_block_id, "r would overwrite N2's block while its backup reads it"
    mgr.check_invariants()
    (backup,) = [m for m in done if m.dst_type is CacheLevel.HOST]
    mgr.complete_swap(backup)
    step(mgr, sh, [r])
    sh.check_request(r)
    for req in (l, r):
        mgr.request_finish(req)
    mgr.check_invariants()

def test_complete_twice_raises():
    mgr, sh = make("write_through")
    cache_prompt(mgr, sh, "a", list(range(9)))
    meta = mgr.issue_pending_backup_to_batch_request()
    sh.copy(meta, True)
    mgr.complete_swap(meta)
    before = snapshot(mgr)
    with pytest.raises(CacheManagerError, match="completed twice"):
        mgr.complete_swap(meta)
    assert snapshot(mgr) == before


def test_completion_resolved_per_block_in_any_grouping():
    mgr, sh = make("write_through", dev=8, host=8)
    rs = [Request(f"r{i}", [i] * 9) for i in range(2)]
    for r in rs:
        admit(mgr, r)
    step(mgr, sh, rs)
    for r in rs:
        mgr.request_finish(r)
    meta = mgr.issue_pending_backup_to_batch_request()
    assert len(meta) == 4
    sh.copy(meta, True)
    # the worker hands it back split in two, in reverse order, with hashes
    parts = [CacheSwapMetadata(meta.src_block_ids[k:k + 2], meta.dst_block_ids[k:k + 2], meta.src_type,
                               meta.dst_type, meta.hash_values[k:k + 2]) for k in (2, 0)]
    bad = CacheSwapMetadata(meta.src_block_ids[:1], meta.dst_block_ids[:1], meta.src_type, meta.dst_type, [42])
    with pytest.raises(CacheManagerError):
        mgr.complete_swap(bad)
    for p in parts:
        p.mark_done(True)
        mgr.complete_swap(p)
    assert mgr.num_copies_in_flight == 0
    assert all(n.state is NodeState.DEVICE_AND_HOST for n in mgr.tree.iter_nodes())


def test_bad_config():
    with pytest.raises(ValueError):
        CacheConfig(block_size=0, num_gpu_blocks=4)
    with pytest.raises(ValueError):
        CacheConfig(num_gpu_blocks=4, write_policy="write_sometimes")
    with pytest.raises(ValueError):
        CacheConfig(num_gpu_blocks=4, write_through_threshold=0)
    with pytest.raises(CacheManagerError):
        CacheManager(CacheConfig(num_gpu_blocks=0))
    cfg = CacheConfig(num_gpu_blocks=4)
    cfg.write_policy = "nope"  # mutated after validation
    with pytest.raises(ValueError):
        CacheManager(cfg)
    with pytest.raises(CacheManagerError):
        CacheManager({"num_gpu_blocks": 4})


def test_reset_cache_and_stats():
    mgr, sh = make("write_through")
    cache_prompt(mgr, sh, "a", list(range(9)))
    meta = mgr.issue_pending_backup_to_batch_request()  # left in flight over the reset
    mgr.reset_cache()
    assert mgr.tree.num_nodes == 0
    assert mgr.device_pool.num_free == 16 - 2  # still held by the in-flight backup
    sh.copy(meta, True)
    mgr.complete_swap(meta)
    assert mgr.device_pool.num_free == 16 and mgr.host_pool.num_free == 16
    mgr.check_invariants()
    s = mgr.get_stats()
    for key in ("hit_rate", "matched_tokens_device", "matched_tokens_host", "device_evictions",
                "swap_in_blocks", "swap_in_bytes", "swap_out_blocks", "swap_out_bytes", "device_usage", "host_usage"):
        assert key in s
    assert s["swap_out_bytes"] == 2 * mgr.bytes_per_block


def test_prefix_caching_disabled():
    mgr, sh = make(enable_prefix_caching=False)
    cache_prompt(mgr, sh, "a", list(range(9)))
    assert mgr.tree.num_nodes == 0 and mgr.device_pool.num_free == 16
    assert mgr.match_prefix(Request("b", list(range(9)))).num_matched_blocks == 0


def test_output_tokens_cached_only_when_configured():
    for flag, expect in ((True, 3), (False, 2)):
        mgr, sh = make(enable_output_caching=flag)
        a = Request("a", list(range(9)))
        admit(mgr, a)
        step(mgr, sh, [a])
        a.output_token_ids += [1, 2, 3, 4]
        mgr.allocate_device_blocks(a, 1)
        step(mgr, sh, [a])
        mgr.request_finish(a)
        assert mgr.tree.num_nodes == expect


def test_write_back_evictions_pair_ids_ascending():
    mgr, sh = make("write_back", dev=9, host=16)
    cache_prompt(mgr, sh, "a", list(range(33)))  # 8 full blocks + 1 token; 8 cached, 1 free
    b = Request("b", list(range(100, 133)))
    admit(mgr, b)  # needs 9: evicts the whole chain, deepest first
    ev = b.cache_evict_metadata[0]
    assert ev.src_block_ids == sorted(ev.src_block_ids)
    assert ev.dst_block_ids == list(range(ev.dst_block_ids[0], ev.dst_block_ids[0] + len(ev)))
    step(mgr, sh, [b])  # the shadow checks every pair's content
    mgr.request_finish(b)
    c = Request("c", list(range(33)) + [5])
    m = mgr.match_prefix(c)
    assert m.num_host_blocks == 8
    assert m.host_block_ids == sorted(m.host_block_ids)  # the load back is one run too


def _tree_state(mgr):
    return sorted((n.hash_value, n.device_block_id, n.host_block_id, n.pending) for n in mgr.tree.iter_nodes())


@pytest.mark.parametrize("policy", ["write_through", "write_through_selective", "write_back"])
def test_infeasible_allocation_evicts_nothing(policy):
    """Defect 3: asking for more blocks than could ever be freed changes nothing."""
    mgr, sh = make(policy, dev=8, host=8)
    cache_prompt(mgr, sh, "a", list(range(13)))  # 3 cached device blocks
    if policy != "write_back":
        step(mgr, sh, [])  # let the write-through backups land
    before_tree, before = _tree_state(mgr), snapshot(mgr)
    big = Request("big", list(range(500, 600)))
    with pytest.raises(NoFreeBlocksError):
        mgr.allocate_device_blocks(big, 9)  # 8 blocks in the whole pool
    assert not mgr.is_running("big") and big.block_tables == [] and big.cache_evict_metadata == []
    assert _tree_state(mgr) == before_tree and snapshot(mgr) == before
    assert mgr.num_copies_in_flight == 0
    assert mgr.issue_pending_backup_to_batch_request() is None  # nothing queued
    assert mgr.match_prefix(Request("x", list(range(13)))).num_device_blocks == 3


def test_first_zero_block_allocation_applies_the_match_once():
    """Defect 12: a first allocate(req, 0) with no device hits must not count the request twice."""
    mgr, sh = make("write_back", dev=8, host=8)
    r = Request("r", list(range(10)))
    mgr.match_prefix(r)
    assert mgr.allocate_device_blocks(r, 0) == []
    mgr.allocate_device_blocks(r, 3)
    s = mgr.get_stats()
    assert s["num_requests"] == 1 and s["query_tokens"] == 10
    mgr.check_invariants()


def _liveness_repro(policy):
    """The issue's trace: a child's backup takes its parent's host copy (host tier of one block)."""
    mgr = CacheManager(CacheConfig(block_size=BS, num_gpu_blocks=3, num_host_blocks=1, write_policy=policy,
                                   write_through_threshold=1))

    def step_(reqs=()):
        b = BatchRequest(list(reqs))
        b.append_evict_metadata(mgr.issue_pending_backup_to_batch_request())
        for m in (b.cache_evict_metadata, b.cache_swap_metadata):
            if m is not None:
                m.mark_done(True)
                mgr.complete_swap(m)

    def admit_(rid, t):
        r = Request(rid, t)
        m = mgr.match_prefix(r)
        mgr.allocate_device_blocks(r, -(-len(t) // BS) - m.num_device_blocks)
        step_([r])
        return r

    P, C = [1, 2, 3, 4], [5, 6, 7, 8]
    a = admit_("a", P + [9])
    a.num_computed_tokens = a.num_total_tokens
    mgr.request_finish(a)
    step_()
    b = admit_("b", P + C + [9])
    b.num_computed_tokens = b.num_total_tokens
    mgr.request_finish(b)
    step_()
    c = admit_("c", list(range(20, 28)))
    mgr.request_finish(c)
    return mgr


@pytest.mark.parametrize("policy", ["write_through", "write_through_selective", "write_back"])
def test_every_cached_block_stays_reclaimable(policy):
    """Defect 11: with nothing running and nothing in flight, all cached + free blocks can be had."""
    mgr = _liveness_repro(policy)
    assert mgr.num_copies_in_flight == 0
    d = Request("d", list(range(100, 112)))
    mgr.match_prefix(d)
    assert mgr.can_allocate_device_blocks(3)
    mgr.allocate_device_blocks(d, 3)
    mgr.check_invariants()


def test_child_backup_never_takes_its_parents_host_copy():
    """Defect 11's cause: with one host block, the child's backup waits instead of evicting the parent's."""
    mgr = _liveness_repro("write_through")
    p = mgr.tree.root.children[Request("p", [1, 2, 3, 4]).block_hashes(BS)[0]]
    assert p.host_block_id is not None  # the one host block still holds the parent
    assert not p.children  # the child never got a host copy, so its eviction dropped it
    mgr.check_invariants()  # includes the host tier's prefix closure


def _two_block_chain_backed_up(split_first_ok):
    mgr, sh = make("write_through", dev=8, host=8)
    a = cache_prompt(mgr, sh, "a", list(range(9)))
    h0, h1 = a.block_hashes(BS)[:2]
    n0 = mgr.tree.root.children[h0]
    n1 = n0.children[h1]
    meta = mgr.issue_pending_backup_to_batch_request()
    assert len(meta) == 2  # parent and child go in the same step
    sh.copy(meta, True)
    return mgr, sh, meta, n0, n1


def _part(meta, node, ok):
    i = meta.hash_values.index(node.hash_value)
    part = CacheSwapMetadata([meta.src_block_ids[i]], [meta.dst_block_ids[i]], meta.src_type, meta.dst_type,
                             [meta.hash_values[i]])
    part.mark_done(ok, None if ok else "injected")
    return part


@pytest.mark.parametrize("child_first", [True, False])
def test_failed_parent_backup_releases_the_host_copies_below(child_first):
    """A failed backup of a parent takes the child's host copy too (landed or still in flight)."""
    mgr, sh, meta, n0, n1 = _two_block_chain_backed_up(True)
    parts = [_part(meta, n1, True), _part(meta, n0, False)]
    if not child_first:
        parts.reverse()
    mgr.complete_swap(parts[0])
    mgr.check_invariants()
    if not child_first:
        assert n0.host_block_id is None and n1.host_block_id is not None  # released when its copy lands
    mgr.complete_swap(parts[1])
    mgr.check_invariants()
    assert n0.host_block_id is None and n1.host_block_id is None and mgr.host_pool.num_free == 8
    retry = mgr.issue_pending_backup_to_batch_request()  # both are tried again, parent with child
    assert sorted(retry.hash_values) == sorted([n0.hash_value, n1.hash_value])
    sh.copy(retry, True)
    mgr.complete_swap(retry)
    assert n0.state is NodeState.DEVICE_AND_HOST and n1.state is NodeState.DEVICE_AND_HOST
    mgr.check_invariants()


def test_ensure_resident_keeps_the_whole_match_and_then_appends():
    """Defect 13: a small first num_tokens never gives up host hits; later calls only append."""
    mgr, sh = push_prompt_to_host()
    c = Request("c", list(range(13)) + [7])
    m = mgr.match_prefix(c)
    assert (m.num_device_blocks, m.num_host_blocks) == (0, 3)
    plan = mgr.ensure_resident(c, 1)
    assert len(c.block_tables) == 3 and plan.new_block_ids == c.block_tables
    assert (plan.num_cached_tokens, plan.num_device_hit_tokens, plan.num_host_hit_tokens) == (12, 0, 12)
    assert plan.num_storage_hit_tokens == 0
    assert c.cache_swap_metadata[0].dst_block_ids == c.block_tables  # loads into the table, in order
    assert c.num_computed_tokens == 12
    plan2 = mgr.ensure_resident(c, c.num_total_tokens)
    assert len(c.block_tables) == 4 and plan2.new_block_ids == c.block_tables[3:]
    assert plan2.num_cached_tokens == 12 and plan2.num_host_hit_tokens == 0
    assert mgr.ensure_resident(c, 10).new_block_ids == []  # already covered
    step(mgr, sh, [c])
    sh.check_request(c)
    s = mgr.get_stats()
    assert s["num_requests"] == 3 and s["matched_tokens_host"] == 12  # a, b, c: c counted once


def test_ensure_resident_errors_say_whether_to_retry():
    mgr, sh = make("write_through", dev=4, host=8)
    cache_prompt(mgr, sh, "a", list(range(9)))
    meta = mgr.issue_pending_backup_to_batch_request()  # both cached blocks pinned by backups
    big = Request("big", list(range(50, 65)))
    before = snapshot(mgr)
    with pytest.raises(NoFreeBlocksError) as err:
        mgr.ensure_resident(big, 16)
    assert err.value.retryable and snapshot(mgr) == before and not mgr.is_running("big")
    sh.copy(meta, True)
    mgr.complete_swap(meta)
    mgr.ensure_resident(big, 16)  # the retry succeeds
    other = Request("other", [1, 2, 3])
    with pytest.raises(NoFreeBlocksError) as err:
        mgr.ensure_resident(other, 3)  # big holds every block: only a finish frees one
    assert not err.value.retryable
    with pytest.raises(CacheManagerError, match="num_tokens"):
        mgr.ensure_resident(other, -1)
    with pytest.raises(CacheManagerError, match="num_tokens"):
        mgr.ensure_resident(other, True)


def test_invariant_checks_survive_python_O():
    """check_invariants raises a named error, not assert, so python -O still checks."""
    import subprocess
    import sys

    code = (
        "from fastdeploy_kvcache.config import CacheConfig\n"
        "from fastdeploy_kvcache.core.cache_manager import CacheManager, InvariantViolation\n"
        "m = CacheManager(CacheConfig(block_size=4, num_gpu_blocks=4))\n"
        "m.device_pool.allocate(1)  # a block nobody owns: free + owned + cached != total\n"
        "try:\n    m.check_invariants()\nexcept InvariantViolation as e:\n    print('caught', e)\n"
    )
    out = subprocess.run([sys.executable, "-O", "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.startswith("caught device: free 3")


def test_host_blocks_are_used_only_once_landed():
    """A host tier still being pinned: evictions go to landed host blocks only; with none
    landed, an eviction drops the block (recompute later) instead of copying it.  (The state
    machine covers every policy with partly landed host tiers.)"""
    cfg = CacheConfig(block_size=BS, num_gpu_blocks=4, num_host_blocks=8, write_policy="write_back")
    mgr = CacheManager(cfg, host_blocks_ready=0)
    sh = ShadowMemory(4, 8, BS)
    assert mgr.get_stats()["host_blocks_ready"] == 0 and mgr.get_stats()["host_blocks_total"] == 8
    cache_prompt(mgr, sh, "a", list(range(13)))
    cache_prompt(mgr, sh, "b", list(range(100, 115)))  # evicts a's blocks: no host block to take
    assert mgr.check_invariants()["host_cached"] == 0
    assert mgr.match_prefix(Request("x", list(range(13)) + [7])).num_matched_blocks == 0
    assert mgr.add_landed_host_blocks(3) == 3
    assert mgr.get_stats()["host_blocks_ready"] == 3
    cache_prompt(mgr, sh, "c", list(range(200, 213)))  # evicts b's blocks to the landed ones
    cache_prompt(mgr, sh, "d", list(range(300, 315)))  # evicts c's: b's host copies make room
    used = {n.host_block_id for n in mgr.tree.iter_nodes() if n.host_block_id is not None}
    assert used == {0, 1, 2}
    counts = mgr.check_invariants()
    assert counts["host_free"] + counts["host_owned"] + counts["host_cached"] == 3
    mgr.add_landed_host_blocks(8)
    e = Request("e", list(range(200, 200 + 4 * len(used))) + [7])
    m = mgr.match_prefix(e)
    assert m.num_host_blocks == len(used)
    mgr.allocate_device_blocks(e, blocks_for(e))
    step(mgr, sh, [e])
    sh.check_request(e)  # the blocks that came back from the landed host blocks are c's
