"""Routing over several replicas: plain Python, with the clock passed in (no sleeps, no processes)."""

import math
from collections import Counter

import pytest

from common.load import ReplicaLoad
from router.replicas import ReplicaSet, Routed, RoutingPolicy, headroom, slot_headroom

SHORT, LONG = 20, 1500


def load(waiting=0, running=0, kv_free=1000, kv_total=1000, max_num_seqs=128, step_s=0.0, ready=True):
    return ReplicaLoad(waiting, running, kv_free, kv_total, max_num_seqs, step_s, ready)


DEFAULT = RoutingPolicy()


def replicas(*ids, now=0.0, policy=DEFAULT, **loads):
    """A set of replicas, each reporting an idle load unless loads[id] says otherwise."""
    rs = ReplicaSet(policy, ids)
    for rid in ids:
        rs.report(rid, loads.get(rid, load()), now)
    return rs


def test_long_requests_go_to_the_replica_with_the_most_headroom():
    rs = replicas(
        "a",
        "b",
        "c",
        a=load(running=100),
        b=load(running=10, kv_free=300),  # few sequences, but KV nearly full of long ones
        c=load(running=40),
    )
    assert rs.choose(LONG, now=0.0) == "c"


def test_waiting_requests_and_slow_steps_cost_headroom():
    rs = replicas("a", "b", a=load(running=10, waiting=30), b=load(running=20))
    assert rs.choose(LONG, now=0.0) == "b"  # 40 sequences ahead on a, 20 on b
    rs = replicas("a", "b", a=load(running=10, step_s=0.5), b=load(running=20, step_s=0.05))
    assert rs.choose(LONG, now=0.0) == "b"  # a has fewer sequences but streams each token ten times slower
    assert rs.choose(SHORT, now=0.0) == "b"


def test_short_requests_go_to_the_least_loaded_replica_where_long_ones_follow_kv():
    # a holds few sequences with long contexts (KV scarce); b many short ones (KV plentiful).
    rs = replicas("a", "b", a=load(running=8, kv_free=100), b=load(running=40, kv_free=900))
    assert rs.choose(SHORT, now=0.0) == "a"
    assert rs.choose(LONG, now=0.0) == "b"
    # The edge is the router's short bucket: 511 is short, 512 is not.
    assert rs.choose(511, now=0.0) == "a"
    assert rs.choose(512, now=0.0) == "b"
    edge = RoutingPolicy(short_edge=2048)
    rs = replicas("a", "b", policy=edge, a=load(running=8, kv_free=100), b=load(running=40, kv_free=900))
    assert rs.choose(LONG, now=0.0) == "a"


def test_scores_agree_when_kv_is_not_the_scarce_resource():
    x = load(running=30, waiting=5, kv_free=900, step_s=0.1)
    assert headroom(x, 3, 1.0) == pytest.approx(slot_headroom(x, 3, 1.0))
    assert headroom(load(), 0, 1.0) == 1.0
    assert headroom(load(kv_free=0), 0, 1.0) == 0.0


@pytest.mark.parametrize("tokens", [SHORT, LONG])
def test_a_burst_before_any_report_spreads_over_the_replicas(tokens):
    rs = replicas("a", "b")
    got = Counter(rs.choose(tokens, now=0.0) for _ in range(32))
    assert got == {"a": 16, "b": 16}
    rs = replicas("a", "b", "c")
    got = Counter(rs.choose(tokens, now=0.0) for _ in range(32))
    assert sorted(got.values()) == [10, 11, 11]


def test_a_burst_spreads_in_proportion_to_capacity():
    rs = replicas("a", "b", a=load(max_num_seqs=256), b=load(max_num_seqs=128))
    got = Counter(rs.choose(LONG, now=0.0) for _ in range(30))
    assert got == {"a": 20, "b": 10}


def test_a_report_replaces_the_pending_count():
    rs = replicas("a", "b")
    for _ in range(4):
        rs.choose(LONG, now=0.0)
    assert [s.pending for s in rs.stats(0.0)] == [2, 2]
    # a's scheduler now counts its two (and finished nothing); b reports before its two arrived.
    rs.report("a", load(running=2), 0.1)
    rs.report("b", load(), 0.1, in_transit=2)
    assert [(s.pending, s.headroom) for s in rs.stats(0.1)] == [(0, 1 - 2 / 128), (2, 1 - 2 / 128)]


def test_ties_go_round_robin_in_id_order():
    rs = replicas("c", "a", "b")
    for rid in ("a", "b", "c"):
        rs.report(rid, load(), 1.0)  # reports reset pending: all tied again at every round
    order = []
    for t in range(6):
        order.append(rs.choose(SHORT, now=1.0 + t))
        for rid in ("a", "b", "c"):
            rs.report(rid, load(), 1.0 + t)
    assert order == ["a", "b", "c", "a", "b", "c"]


def test_down_or_unready_replicas_are_never_chosen():
    rs = replicas("a", "b", "c", b=load(ready=False))
    rs.mark_down("a", 0.0)
    assert {rs.choose(t, now=0.0) for t in (SHORT, LONG) for _ in range(10)} == {"c"}
    assert rs.choose(LONG, now=0.0, allowed={"a", "b"}) is None


def test_a_replica_is_down_until_its_first_ready_report():
    rs = ReplicaSet(RoutingPolicy(), ["a"])
    assert not rs.healthy(0.0) and rs.choose(SHORT, now=0.0) is None
    rs.report("a", load(ready=False, kv_total=0, kv_free=0), 0.0)
    assert not rs.healthy(0.0)
    assert rs.stats(0.0)[0].reason == "shards not ready"
    rs.report("a", load(), 0.5)
    assert rs.healthy(0.5) and rs.choose(SHORT, now=0.5) == "a"


def test_stale_reports_mark_a_replica_down_and_a_fresh_ready_report_brings_it_up():
    rs = replicas("a", "b", policy=RoutingPolicy(stale_after_s=3.0))
    rs.report("b", load(), 2.0)
    assert rs.expire(3.0) == []
    assert rs.choose(LONG, now=3.5, allowed={"a"}) is None  # a is stale even before expire runs
    assert rs.expire(3.5) == ["a"]
    assert rs.expire(3.6) == []  # reported once
    assert [(s.replica, s.up, s.reason) for s in rs.stats(3.6)] == [("a", False, "stale"), ("b", True, "")]
    assert {rs.choose(SHORT, now=3.6) for _ in range(4)} == {"b"}
    rs.report("a", load(ready=False), 4.0)
    assert not rs.is_up("a", 4.0)
    assert rs.expire(4.0) == []
    rs.report("a", load(), 4.1)
    assert rs.is_up("a", 4.1)
    assert rs.stats(4.1)[0].report_age_s == 0.0


def test_a_broken_stream_marks_down_until_the_next_ready_report():
    rs = replicas("a", "b")
    rs.choose(LONG, now=0.0)
    rs.mark_down("a", 0.1)
    assert not rs.is_up("a", 0.1) and rs.stats(0.1)[0].reason == "stream broke"
    assert rs.stats(0.1)[0].pending == 0
    assert rs.healthy(0.1)
    rs.mark_down("b", 0.2)
    assert not rs.healthy(0.2) and rs.choose(SHORT, now=0.2) is None
    rs.report("b", load(), 0.3)
    assert rs.healthy(0.3)


def test_none_available_gives_none():
    assert ReplicaSet().choose(SHORT, now=0.0) is None
    rs = replicas("a", policy=RoutingPolicy(stale_after_s=1.0))
    assert rs.choose(SHORT, now=5.0) is None
    assert not rs.healthy(5.0)


def test_membership_changes():
    rs = replicas("a", "b")
    rs.add("c")  # new from DNS: down until it reports
    assert {rs.choose(SHORT, now=0.0) for _ in range(6)} == {"a", "b"}
    rs.report("c", load(), 0.0)
    assert rs.choose(SHORT, now=0.0) == "c"  # a and b have pending work; c has none
    rs.remove("a")
    assert rs.ids() == ["b", "c"] and "a" not in rs
    with pytest.raises(KeyError):
        rs.report("a", load(), 0.0)  # a stream that outlived its replica's removal: the link drops it


def test_failover_resends_requests_with_attempts_left_streamed_or_not():
    rs = replicas("a", "b")
    cap = rs.policy.max_attempts
    assert rs.may_resend(Routed("a", LONG))
    assert rs.may_resend(Routed("a", SHORT, attempts=cap - 1))  # streamed or not: it resumes where it stopped
    assert not rs.may_resend(Routed("a", SHORT, attempts=cap))  # it may be what crashes schedulers


def test_stats_per_replica():
    rs = replicas("b", "a", a=load(running=64, waiting=10, step_s=0.1))
    rs.choose(SHORT, now=0.0)
    rs.mark_down("b", 0.0)
    a, b = rs.stats(1.0)
    assert (a.replica, a.up, a.reason, a.report_age_s, a.pending) == ("a", True, "", 1.0, 0)
    assert a.routed_total == 0
    assert a.headroom == pytest.approx(0.5 - 10 / 128 - 0.1)
    assert a.load.running == 64
    assert (b.up, b.reason, b.headroom, b.routed_total) == (False, "stream broke", -math.inf, 1)


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(short_edge=0),
        dict(stale_after_s=0),
        dict(stale_after_s=math.inf),
        dict(slow_step_s=-1.0),
        dict(cache_weight=-0.1),
        dict(cache_index_blocks=0),
        dict(routing_policy="random"),
        dict(max_attempts=0),
    ],
)
def test_bad_policies_are_refused(kwargs):
    with pytest.raises(ValueError):
        RoutingPolicy(**kwargs)


def test_bad_reports_are_refused():
    with pytest.raises(ValueError, match="max_num_seqs"):
        load(max_num_seqs=0)
    with pytest.raises(ValueError, match="kv_blocks_free"):
        load(kv_free=2, kv_total=1)
    with pytest.raises(ValueError, match="step_seconds"):
        load(step_s=math.nan)
    with pytest.raises(ValueError, match="in_transit"):
        ReplicaSet(RoutingPolicy(), ["a"]).report("a", load(), 0.0, in_transit=-1)


def test_a_replica_waiting_for_its_shards_that_goes_silent_is_expired():
    # Its requests wait in the scheduler for the shards; if the scheduler itself goes silent they must
    # fail over, so expire reports it like an up replica.
    rs = replicas("a", "b", policy=RoutingPolicy(stale_after_s=3.0))
    rs.report("a", load(ready=False), 1.0)
    rs.report("b", load(), 4.5)
    assert rs.expire(4.5) == ["a"]
    assert rs.stats(4.5)[0].reason == "stale"


def test_a_load_travels_as_a_load_report_and_comes_back_equal():
    from common.pb.tpserve.internal.v1 import scheduler_pb2

    load = ReplicaLoad(
        waiting=3, running=5, kv_blocks_free=7, kv_blocks_total=64, max_num_seqs=128, step_seconds=0.034,
        shards_ready=True, swapped=2,
    )  # fmt: skip
    msg = scheduler_pb2.LoadReport()
    load.fill(msg)
    assert ReplicaLoad.from_message(msg) == load
    msg.kv_blocks_free = 65  # more free than there are: no scheduler sends that
    with pytest.raises(ValueError, match="kv_blocks_free"):
        ReplicaLoad.from_message(msg)
