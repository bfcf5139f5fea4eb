"""Bookkeeping invariants of the cache manager, checked by ``CacheManager.check_invariants``.

O(cache size): for tests and debugging, not for a serving loop; it reads the manager's
parts through their read-only views (never their private state).  Violations raise
``InvariantViolation`` (never ``assert``), so ``python -O`` still checks them.

What is checked: per pool, free + owned + cached = total and no block is claimed
twice; ref counts equal the running requests' references; per-tier child counts;
no empty node in the tree; in-flight entries and node ``pending`` agree; and, under
the through policies, the host tier is prefix-closed (the liveness rule).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from fastdeploy_kvcache.core.errors import InvariantViolation
from fastdeploy_kvcache.core.metadata import CacheLevel

if TYPE_CHECKING:  # pragma: no cover
    from fastdeploy_kvcache.core.cache_manager import CacheManager

__all__ = ["InvariantViolation", "check_invariants"]

_DEV = CacheLevel.DEVICE


def check_invariants(mgr: 'CacheManager') -> dict[str, int]:
    """Verify every bookkeeping invariant; O(cache size), for tests and debugging.

    Raises InvariantViolation naming the first violation; returns per-pool counts.
    """
    # A host tier still being pinned counts only its landed blocks (BlockPool.num_ready).
    dev_total, host_total = (mgr.device_pool.num_blocks, mgr.host_pool.num_ready)
    dev_claims: dict[int, str] = {}
    host_claims: dict[int, str] = {}

    def claim(claims: dict[int, str], bid: int, who: str) -> None:
        if bid in claims:
            raise InvariantViolation(f'block {bid} claimed by {claims[bid]} and {who}')
        claims[bid] = who
    requests = mgr.allocator.requests
    inflight = mgr.inflight
    detached = mgr.evictor.detached
    host_doomed = mgr.copies.host_doomed
    refs: dict[int, int] = {}
    dev_owned = 0
    for rid, st in requests.items():
        req = st.request
        if req.block_tables != st.block_ids:
            raise InvariantViolation(f'{rid}: block table diverged')
        if len(st.nodes) != len(st.block_ids):
            raise InvariantViolation('invariant violated')
        for i, (b, node) in enumerate(zip(st.block_ids, st.nodes)):
            if node is None:
                claim(dev_claims, b, f'request {rid}[{i}]')
                dev_owned += 1
            else:
                if node.device_block_id != b:
                    raise InvariantViolation(f'{rid}[{i}]: node {node} is not on block {b}')
                refs[id(node)] = refs.get(id(node), 0) + 1
                if node.detached:
                    if node not in detached:
                        raise InvariantViolation(f'{rid}[{i}]: detached node not tracked: {node}')
        for i, b in st.standby.items():
            claim(dev_claims, b, f'request {rid} standby [{i}]')
            dev_owned += 1
            node = st.nodes[i] if i < len(st.nodes) else None
            inf = inflight.get(CacheLevel.HOST, _DEV, st.block_ids[i]) if node is not None else None
            if inf is None or inf.node is not node or inf.sharers.get(rid) != b:
                raise InvariantViolation(f'{rid}[{i}]: standby block {b} without a shared load in flight')
    dev_cached = 0
    host_cached = 0
    for node in mgr.tree.iter_nodes():
        if node.detached:
            raise InvariantViolation(repr(node))
        if not (node.device_block_id is not None or node.host_block_id is not None):
            raise InvariantViolation(f'empty node {node}')
        if node.ref_count != refs.pop(id(node), 0):
            raise InvariantViolation(f'ref count of {node}')
        nd = sum((1 for c in node.children.values() if c.device_block_id is not None))
        nh = sum((1 for c in node.children.values() if c.host_block_id is not None))
        if not (node.num_device_children == nd and node.num_host_children == nh):
            raise InvariantViolation(f'child counts of {node}')
        for c in node.children.values():
            if not (c.parent is node and c.depth == node.depth + 1):
                raise InvariantViolation('invariant violated')
        if node.device_block_id is not None:
            claim(dev_claims, node.device_block_id, f'node {node.hash_value:#x}')
            if node.ref_count:
                dev_owned += 1
            else:
                dev_cached += 1
        elif node.ref_count != 0:
            raise InvariantViolation(f'referenced node without device copy: {node}')
        if node.host_block_id is not None:
            claim(host_claims, node.host_block_id, f'node {node.hash_value:#x}')
            host_cached += 1
        if node.pending is not None:
            if not any((inf.node is node for _, inf in inflight.items())):
                raise InvariantViolation(f'pending without copy: {node}')
    root = mgr.tree.root
    if mgr.host_prefix_closed:
        for node in mgr.tree.iter_nodes():
            if node.host_block_id is not None and node.parent is not root:
                if not (node.parent.host_block_id is not None or node in host_doomed):
                    raise InvariantViolation(f'host tier not prefix-closed: {node} has a host copy, its parent {node.parent} none')
    for node in host_doomed:
        if not (node.pending is not None and node.host_block_id is not None):
            raise InvariantViolation(f'doomed host copy not in flight: {node}')
    if mgr.tree.num_nodes != sum((1 for _ in mgr.tree.iter_nodes())):
        raise InvariantViolation('node count')
    if root.num_device_children != sum((1 for c in root.children.values() if c.device_block_id is not None)):
        raise InvariantViolation('invariant violated')
    if root.num_host_children != sum((1 for c in root.children.values() if c.host_block_id is not None)):
        raise InvariantViolation('invariant violated')
    host_owned = 0
    for node in detached:
        if not (node.detached and (node.ref_count or node.pending is not None)):
            raise InvariantViolation(repr(node))
        if node.ref_count != refs.pop(id(node), 0):
            raise InvariantViolation(f'ref count of detached {node}')
        if node.device_block_id is not None:
            claim(dev_claims, node.device_block_id, f'detached {node.hash_value:#x}')
            dev_owned += 1
        if node.host_block_id is not None:
            claim(host_claims, node.host_block_id, f'detached {node.hash_value:#x}')
            host_owned += 1
    if mgr.storage is not None:
        # Host blocks the storage tier owns outside the tree: gets in flight, and blocks the
        # tree freed while a put still reads them (pinned, their free deferred).
        mgr.storage.check_invariants()
        for b, who in mgr.storage.held_host_blocks():
            claim(host_claims, b, who)
            host_owned += 1
    for (stier, dtier, dst), inf in inflight.items():
        for rid, b in inf.sharers.items():
            sst = requests.get(rid)
            if sst is None or b not in sst.standby.values():
                raise InvariantViolation(f'load to device {dst} shared by {rid}, which holds no standby block {b}')
        if inf.node.pending is not inf.kind:
            raise InvariantViolation(f'in-flight {inf.kind.name} but node says {inf.node.pending}')
        if dtier is _DEV:
            if inf.node.device_block_id != dst:
                raise InvariantViolation('invariant violated')
        elif inf.node.host_block_id != dst:
            raise InvariantViolation('invariant violated')
    if refs:
        raise InvariantViolation(f'{len(refs)} referenced nodes are neither in the tree nor tracked as detached')
    dev_free = set(mgr.device_pool.free_ids())
    host_free = set(mgr.host_pool.free_ids())
    if dev_free & dev_claims.keys():
        raise InvariantViolation(f'free device blocks also in use: {sorted(dev_free & dev_claims.keys())}')
    unlanded = [b for b in host_claims if b >= host_total]
    if unlanded:
        raise InvariantViolation(f'host blocks in use before their memory landed (ready: {host_total}): {sorted(unlanded)[:8]}')
    if host_free & host_claims.keys():
        raise InvariantViolation(f'free host blocks also in use: {sorted(host_free & host_claims.keys())}')
    if len(dev_free) + dev_owned + dev_cached != dev_total:
        raise InvariantViolation(f'device: free {len(dev_free)} + owned {dev_owned} + cached {dev_cached} != {dev_total}')
    if len(host_free) + host_owned + host_cached != host_total:
        raise InvariantViolation(f'host: free {len(host_free)} + owned {host_owned} + cached {host_cached} != {host_total}')
    if dev_cached != mgr.stats.cached_device:
        raise InvariantViolation(f'cached counter {mgr.stats.cached_device} != {dev_cached}')
    return {'device_free': len(dev_free), 'device_owned': dev_owned, 'device_cached': dev_cached, 'host_free': len(host_free), 'host_owned': host_owned, 'host_cached': host_cached}
