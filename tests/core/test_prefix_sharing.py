"""``PrefixSharing`` alone (pure Python, a fake clock): who is held, for how long, and what
releases a hold."""

from __future__ import annotations

import pytest

from fastdeploy_kvcache.core.prefix_sharing import PrefixSharing
from fastdeploy_kvcache.core.request import Request

BS = 4
PREFIX = list(range(10, 10 + 8 * BS))  # 8 full blocks


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def _req(rid: str, tail: int) -> Request:
    return Request(rid, PREFIX + [tail, tail + 1])


def test_a_follower_is_held_until_the_leader_commits_the_shared_blocks():
    sh = PrefixSharing(BS, max_hold_s=5.0, clock=Clock())
    leader, follower = _req("a", 1), _req("b", 2)
    sh.admitted(leader, 0)
    assert sh.num_blocks_being_computed == 8
    assert sh.should_hold(follower, 0)
    sh.leader_progress("a", 3)  # 3 blocks matchable: the follower would match them, still held
    assert sh.should_hold(follower, 3 * BS)
    sh.leader_progress("a", 8)
    assert not sh.should_hold(follower, 8 * BS)
    sh.admitted(follower, 8 * BS)
    assert sh.stats.held_requests == 1 and sh.stats.held_reused_tokens == 8 * BS
    assert sh.num_blocks_being_computed == 0  # the follower computes no prefix block


def test_the_hold_expires_and_is_never_taken_again():
    clock = Clock()
    sh = PrefixSharing(BS, max_hold_s=2.0, clock=clock)
    sh.admitted(_req("a", 1), 0)
    follower = _req("b", 2)
    assert sh.should_hold(follower, 0)
    clock.now += 1.9
    assert sh.should_hold(follower, 0)
    clock.now += 0.2
    assert not sh.should_hold(follower, 0)
    assert not sh.should_hold(follower, 0)  # expired for good, whatever the leader does
    assert sh.stats.hold_expired == 1


def test_a_leader_that_leaves_releases_its_followers():
    sh = PrefixSharing(BS, max_hold_s=5.0, clock=Clock())
    sh.admitted(_req("a", 1), 0)
    follower = _req("b", 2)
    assert sh.should_hold(follower, 0)
    sh.leader_gone("a")  # preempted, finished or aborted
    assert not sh.should_hold(follower, 0)
    sh.admitted(follower, 0)  # it computes the prefix now: the next one waits for it
    assert sh.should_hold(_req("c", 3), 0)
    sh.forget("b")
    assert sh.num_blocks_being_computed == 0


def test_off_and_unrelated_requests_are_never_held():
    sh = PrefixSharing(BS, max_hold_s=0.0)
    sh.admitted(_req("a", 1), 0)
    assert not sh.enabled and not sh.should_hold(_req("b", 2), 0)
    on = PrefixSharing(BS, max_hold_s=5.0)
    on.admitted(_req("a", 1), 0)
    assert not on.should_hold(Request("x", list(range(600, 640))), 0)
    with pytest.raises(ValueError, match="max_hold_s"):
        PrefixSharing(BS, max_hold_s=-1.0)
