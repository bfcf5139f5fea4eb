import pytest

from fastdeploy_kvcache.core.metadata import CacheLevel, NodeState, TransferKind
from fastdeploy_kvcache.core.radix_tree import RadixTree


def chain(tree, hashes, parent=None, dev_start=0):
    parent = parent or tree.root
    out = []
    for i, h in enumerate(hashes):
        node = tree.add_child(parent, h)
        tree.set_device(node, dev_start + i)
        out.append(node)
        parent = node
    return out


def test_match_walks_device_then_host_and_stops():
    tree = RadixTree()
    a, b, c = chain(tree, [1, 2, 3])
    tree.clear_device(c)
    tree.set_host(c, 7)
    nodes, tiers = tree.match([1, 2, 3, 4], 10)
    assert nodes == [a, b, c] and tiers == [CacheLevel.DEVICE, CacheLevel.DEVICE, CacheLevel.HOST]
    assert tree.match([1, 2, 3], 2)[0] == [a, b]  # max_blocks
    c.pending = TransferKind.EVICT  # host copy still being written: not usable
    assert tree.match([1, 2, 3], 10)[0] == [a, b]
    c.pending = None
    b.pending = TransferKind.SWAP_IN  # a load in flight matches: the manager shares it
    b.host_block_id = 9
    nodes, tiers = tree.match([1, 2, 3], 10)
    assert nodes == [a, b, c] and tiers[1] is CacheLevel.DEVICE


def test_only_leaves_are_offered_lru_first():
    tree = RadixTree()
    a, b = chain(tree, [1, 2])
    c, = chain(tree, [3], parent=a, dev_start=5)  # a has two children: b and c
    tree.touch(c)  # c is most recent
    assert tree.device_heap.pop() is b
    tree.clear_device(b)
    tree.remove(b)
    assert tree.device_heap.pop() is c  # a is interior until c goes
    tree.clear_device(c)
    tree.remove(c)
    assert tree.device_heap.pop() is a
    assert tree.device_heap.pop() is None


def test_refs_and_in_flight_block_eviction():
    tree = RadixTree()
    a, = chain(tree, [1])
    a.ref_count = 1
    tree.offer(a)
    assert tree.device_heap.pop() is None
    a.ref_count = 0
    a.pending = TransferKind.BACKUP
    tree.offer(a)
    assert tree.device_heap.pop() is None
    a.pending = None
    tree.offer(a)
    assert tree.device_heap.pop() is a


def test_every_device_leaf_is_offered_whatever_its_children():
    """Liveness: a device leaf whose children live on host only is still an eviction candidate
    (the cache manager copies it to host, or drops it with that host subtree)."""
    tree = RadixTree()
    a, b = chain(tree, [1, 2])
    tree.clear_device(b)
    tree.set_host(b, 0)  # b lives on host only; a is a device leaf with a child
    assert tree.device_heap.peek() is a  # peek leaves it in
    assert tree.device_heap.pop() is a
    assert tree.device_heap.peek() is None and tree.device_heap.pop() is None


def test_host_heap_and_remove_guards():
    tree = RadixTree()
    a, b = chain(tree, [1, 2])
    tree.set_host(a, 0)
    tree.set_host(b, 1)
    assert tree.host_heap.pop() is b  # leaf of the host tier
    with pytest.raises(AssertionError):
        tree.remove(b)  # still has data
    assert a.state is NodeState.DEVICE_AND_HOST


def test_heap_compaction_keeps_it_bounded():
    tree = RadixTree()
    nodes = chain(tree, [1])
    a = nodes[0]
    for _ in range(10_000):
        tree.touch(a)
        tree.offer(a)
    assert len(tree.device_heap) < 200
    assert tree.device_heap.pop() is a


def test_detach_subtree():
    tree = RadixTree()
    a, b, c = chain(tree, [1, 2, 3])
    out = tree.detach_subtree(b)
    assert out[0] is b and set(out) == {b, c} and all(n.detached for n in out)
    assert tree.num_nodes == 1 and a.num_device_children == 0 and not a.children
