"""The router's admission queue and credits: plain Python, with the clock passed in (no sleeps)."""

import math
import random

import pytest

from router.buckets import AdmissionPolicy, AdmissionQueue, BucketStats, Credits

SHORT, MEDIUM, LONG = 10, 1000, 3000


def drain(q, now):
    out = []
    while (item := q.pop(now)) is not None:
        out.append(item)
    return out


def test_buckets_split_at_the_edges():
    q = AdmissionQueue()
    assert [q.bucket_of(n) for n in (0, 511, 512, 2047, 2048, 100_000)] == [0, 0, 1, 1, 2, 2]
    assert AdmissionQueue(AdmissionPolicy(bucket_edges=())).bucket_of(10**6) == 0  # no edges: one FIFO queue


def test_twenty_shorts_just_after_a_long_one_all_go_first():
    q = AdmissionQueue(AdmissionPolicy(max_queue_wait_ms=2.0 * 1000))
    assert q.push("long", LONG, now=0.0)
    for i in range(20):
        assert q.push(f"s{i}", SHORT, now=0.001 * (i + 1))
    # Admitted one at a time as the scheduler grants room, all before the long one is overdue.
    order = [q.pop(now=0.1 + 0.05 * i) for i in range(21)]
    assert order == [f"s{i}" for i in range(20)] + ["long"]
    assert q.pop(now=5.0) is None and len(q) == 0


def test_medium_goes_between_short_and_long():
    q = AdmissionQueue()
    q.push("long", LONG, 0.0)
    q.push("medium", MEDIUM, 0.0)
    q.push("short", SHORT, 0.0)
    assert drain(q, 0.5) == ["short", "medium", "long"]


def test_fifo_within_a_bucket():
    q = AdmissionQueue()
    for i in range(10):
        q.push(("s", i), SHORT + i, now=float(i) * 0.01)
        q.push(("l", i), LONG + i, now=float(i) * 0.01)
    assert drain(q, 0.2) == [("s", i) for i in range(10)] + [("l", i) for i in range(10)]


def test_a_steady_stream_of_shorts_does_not_delay_a_long_one_past_the_aging_bound():
    max_wait, tick = 1.0, 0.01
    q = AdmissionQueue(AdmissionPolicy(max_queue_wait_ms=max_wait * 1000, max_queued_requests=10_000))
    q.push("long", LONG, now=0.0)
    # Shorts arrive twice as fast as the scheduler takes requests, so a short always waits.
    popped_at = None
    n = 0
    for step in range(1, 1000):
        now = step * tick
        for _ in range(2):
            q.push(f"s{n}", SHORT, now)
            n += 1
        if q.pop(now) == "long":
            popped_at = now
            break
    assert popped_at is not None
    # The first admission after the bound passed is the long one: not before (shorts first), not later.
    assert max_wait < popped_at <= max_wait + tick + 1e-9


def test_oldest_overdue_first_across_buckets():
    q = AdmissionQueue(AdmissionPolicy(max_queue_wait_ms=1.0 * 1000))
    q.push("long-old", LONG, 0.0)
    q.push("medium-older-than-short", MEDIUM, 0.1)
    q.push("short-overdue", SHORT, 0.2)
    q.push("short-fresh", SHORT, 2.0)
    assert drain(q, 2.0) == ["long-old", "medium-older-than-short", "short-overdue", "short-fresh"]


def test_exactly_max_wait_is_not_yet_overdue():
    q = AdmissionQueue(AdmissionPolicy(max_queue_wait_ms=1.0 * 1000))
    q.push("long", LONG, 0.0)
    q.push("short", SHORT, 0.5)
    assert q.pop(1.0) == "short"


def test_zero_max_wait_is_fifo_across_buckets_except_for_ties():
    q = AdmissionQueue(AdmissionPolicy(max_queue_wait_ms=0 * 1000))
    q.push("long", LONG, 0.0)
    q.push("short", SHORT, 0.1)
    q.push("tie-long", LONG, 0.2)
    q.push("tie-short", SHORT, 0.2)
    assert drain(q, 0.2) == ["long", "short", "tie-short", "tie-long"]


def test_bound_refuses_at_max_queued_and_accepts_after_a_pop():
    q = AdmissionQueue(AdmissionPolicy(max_queued_requests=3))
    assert all(q.push(i, SHORT, 0.0) for i in range(3))
    assert q.push(3, SHORT, 0.0) is False
    assert 3 not in q and len(q) == 3  # a refused request leaves no trace
    assert q.pop(0.1) == 0
    assert q.push(3, LONG, 0.1) is True
    assert q.push(4, SHORT, 0.1) is False
    q.remove(1)
    assert q.push(4, SHORT, 0.1) is True


def test_remove_a_cancelled_request():
    q = AdmissionQueue()
    for i in range(5):
        q.push(f"item{i}", SHORT, 0.0, key=f"r{i}")
    q.push("long", LONG, 0.0, key="rl")
    assert "r2" in q
    assert q.remove("r2") == "item2"
    assert "r2" not in q and len(q) == 5
    assert q.remove("r2") is None  # twice, or after it was popped: nothing to do
    assert q.remove("unknown") is None
    assert q.remove("rl") == "long"
    assert drain(q, 0.1) == ["item0", "item1", "item3", "item4"]
    assert q.remove("r0") is None


def test_remove_by_item_when_no_key_is_given():
    q = AdmissionQueue()
    q.push("a", SHORT, 0.0)
    q.push("b", SHORT, 0.0)
    assert q.remove("a") == "a"
    assert drain(q, 0.0) == ["b"]


def test_a_key_already_queued_is_an_error():
    q = AdmissionQueue()
    q.push("x", SHORT, 0.0, key="r1")
    with pytest.raises(ValueError, match="already queued"):
        q.push("y", LONG, 0.0, key="r1")
    assert len(q) == 1


@pytest.mark.parametrize(
    "edges, match",
    [
        ((2048, 512), "strictly increasing"),
        ((512, 512), "strictly increasing"),
        ((0, 512), "positive integers"),
        ((-1,), "positive integers"),
        ((512.0,), "positive integers"),
        ((True,), "positive integers"),
        (("512",), "positive integers"),
    ],
)
def test_bad_edges_are_rejected(edges, match):
    with pytest.raises(ValueError, match=match):
        AdmissionQueue(AdmissionPolicy(bucket_edges=edges))


@pytest.mark.parametrize("max_queued", [0, -1, 1.5, True, None])
def test_bad_max_queued_is_rejected(max_queued):
    with pytest.raises(ValueError, match="max-queued-requests"):
        AdmissionQueue(AdmissionPolicy(max_queued_requests=max_queued))


@pytest.mark.parametrize("max_wait_ms", [-100, math.inf, math.nan, "1000", None])
def test_bad_max_wait_is_rejected(max_wait_ms):
    with pytest.raises(ValueError, match="max-queue-wait-ms"):
        AdmissionQueue(AdmissionPolicy(max_queue_wait_ms=max_wait_ms))


@pytest.mark.parametrize("prompt_tokens", [-1, 1.5, None])
def test_bad_prompt_tokens_are_rejected(prompt_tokens):
    with pytest.raises(ValueError, match="prompt_tokens"):
        AdmissionQueue().push("x", prompt_tokens, 0.0)


def test_stats_per_bucket():
    q = AdmissionQueue()
    assert q.stats(0.0) == [
        BucketStats("0-511", 0, 512, 0, 0.0),
        BucketStats("512-2047", 512, 2048, 0, 0.0),
        BucketStats("2048+", 2048, None, 0, 0.0),
    ]
    q.push("l", LONG, 1.0)
    q.push("s1", SHORT, 2.0)
    q.push("s2", SHORT, 3.0)
    stats = q.stats(4.0)
    assert [(s.waiting, s.oldest_wait_s) for s in stats] == [(2, 2.0), (0, 0.0), (1, 3.0)]
    assert q.pop(4.0) == "l"  # overdue (3 s > max_wait_s)
    assert q.pop(4.0) == "s1"
    assert q.stats(4.5) == [
        BucketStats("0-511", 0, 512, 1, 1.5),
        BucketStats("512-2047", 512, 2048, 0, 0.0),
        BucketStats("2048+", 2048, None, 0, 0.0),
    ]


def test_stats_with_custom_edges():
    q = AdmissionQueue(AdmissionPolicy(bucket_edges=(128,)))
    assert [(s.name, s.lower, s.upper) for s in q.stats(0.0)] == [("0-127", 0, 128), ("128+", 128, None)]


def test_matches_a_naive_reference_on_random_traffic():
    """The rules stated directly over all waiting items, against the O(buckets) implementation."""
    rng = random.Random(0)
    max_wait = 0.5
    q = AdmissionQueue(
        AdmissionPolicy(bucket_edges=(512, 2048), max_queued_requests=50, max_queue_wait_ms=max_wait * 1000)
    )
    ref: list[tuple[int, int, float]] = []  # (order, bucket, arrival)
    now, order = 0.0, 0
    for _ in range(5000):
        now += rng.choice([0.0, 0.001, 0.01, 0.1])
        op = rng.random()
        if op < 0.5:
            tokens = rng.choice([rng.randrange(512), rng.randrange(512, 2048), rng.randrange(2048, 8192)])
            accepted = q.push(order, tokens, now)
            assert accepted == (len(ref) < 50)
            if accepted:
                ref.append((order, q.bucket_of(tokens), now))
            order += 1
        elif op < 0.9:
            overdue = [e for e in ref if now - e[2] > max_wait]
            want = min(overdue) if overdue else min(ref, key=lambda e: (e[1], e[0]), default=None)
            if want is not None:
                ref.remove(want)
            assert q.pop(now) == (want[0] if want else None)
        elif ref:
            victim = rng.choice(ref)
            ref.remove(victim)
            assert q.remove(victim[0]) == victim[0]
        assert len(q) == len(ref)


def test_credits_follow_the_scheduler_window_minus_adds_in_flight():
    c = Credits()
    assert c.available == 0 and not c.take()  # nothing is sent before the scheduler grants room
    c.update(window=3, received=0)
    assert [c.take() for _ in range(4)] == [True, True, True, False]
    # A report computed before the scheduler read those 3 adds: they use up its window, no over-send.
    c.update(window=3, received=0)
    assert c.available == 0
    # The scheduler read them, admitted two, and wants two more.
    c.update(window=2, received=3)
    assert c.available == 2
    assert c.take()
    c.update(window=2, received=3)  # a repeated report changes nothing
    assert c.available == 1
    c.update(window=0, received=4)
    assert c.available == 0


def test_credits_reset_with_a_new_stream_and_reject_impossible_reports():
    c = Credits()
    c.update(window=5, received=0)
    c.take()
    with pytest.raises(ValueError, match="only 1 were sent"):
        c.update(window=5, received=2)
    with pytest.raises(ValueError, match=">= 0"):
        c.update(window=-1, received=0)
    c.update(window=5, received=1)
    c.update(window=9, received=0)  # older than the report applied: ignored
    assert c.available == 5
    c.reset()
    assert c.available == 0 and c.sent == 0


def test_admit_sends_as_many_as_there_is_credit_for_in_queue_order():
    q = AdmissionQueue()
    c = Credits()
    q.push("long", LONG, 0.0)
    for i in range(3):
        q.push(f"s{i}", SHORT, 0.1)
    assert admit(q, c, 0.2) == []  # no credit yet
    c.update(window=2, received=0)
    assert admit(q, c, 0.2) == ["s0", "s1"]
    assert len(q) == 2
    c.update(window=10, received=2)
    assert admit(q, c, 0.3) == ["s2", "long"]
    assert c.available == 8  # credit left over is not spent on an empty queue


def admit(queue: AdmissionQueue, credits: Credits, now: float) -> list:
    """What the router's pump does with one replica: pop as many requests as there is credit for."""
    out = []
    while len(queue) and credits.take():
        out.append(queue.pop(now))
    return out


def test_higher_priority_first_then_shortest_bucket_then_fifo():
    q = AdmissionQueue()
    q.push("short", SHORT, 0.0)
    q.push("long-high", LONG, 0.1, priority=-1)
    q.push("short-low", SHORT, 0.2, priority=3)
    q.push("medium-high", MEDIUM, 0.3, priority=-1)
    q.push("short-2", SHORT, 0.4)
    assert drain(q, 0.5) == ["medium-high", "long-high", "short", "short-2", "short-low"]
    assert len(q) == 0 and q.stats(0.5)[0].waiting == 0


def test_a_stream_of_higher_priorities_does_not_delay_a_low_one_past_the_aging_bound():
    max_wait, tick = 1.0, 0.01
    q = AdmissionQueue(AdmissionPolicy(max_queue_wait_ms=max_wait * 1000, max_queued_requests=10_000))
    q.push("low", SHORT, now=0.0, priority=5)
    popped_at, n = None, 0
    for step in range(1, 1000):  # higher priorities arrive twice as fast as requests leave
        now = step * tick
        for _ in range(2):
            q.push(f"h{n}", SHORT, now, priority=0)
            n += 1
        if q.pop(now) == "low":
            popped_at = now
            break
    assert popped_at is not None
    assert max_wait < popped_at <= max_wait + tick + 1e-9  # the first admission after the bound passed


def test_an_overdue_low_priority_goes_before_a_fresh_high_one_and_the_oldest_overdue_first():
    q = AdmissionQueue(AdmissionPolicy(max_queue_wait_ms=1.0 * 1000))
    q.push("low-old", LONG, 0.0, priority=9)
    q.push("high-old", SHORT, 0.5, priority=-9)
    q.push("high-fresh", SHORT, 1.9, priority=-9)
    assert q.pop(2.0) == "low-old"  # waited 2 s > 1 s, the oldest overdue
    assert drain(q, 2.0) == ["high-old", "high-fresh"]


def test_ahead_counts_what_leaves_the_queue_before_a_new_request():
    q = AdmissionQueue()
    q.push("s0", SHORT, 0.0)
    q.push("l0", LONG, 0.0)
    q.push("s-high", SHORT, 0.0, priority=-1)
    q.push("l-high", LONG, 0.0, priority=-1)
    q.push("s-low", SHORT, 0.0, priority=1)
    assert q.ahead(SHORT, 0) == 3  # both higher ones, and s0
    assert q.ahead(LONG, 0) == 4  # and l0
    assert q.ahead(SHORT, -1) == 1 and q.ahead(MEDIUM, -1) == 1 and q.ahead(LONG, -1) == 2
    assert q.ahead(SHORT, 1) == 5  # every other one goes first
    assert q.ahead(SHORT, -5) == 0


def test_requeue_and_remove_keep_each_request_in_its_priority():
    q = AdmissionQueue()
    q.push("low", SHORT, 0.0, key="r-low", priority=1)
    q.push("high", SHORT, 0.1, key="r-high", priority=-1)
    assert q.pop(0.2) == "high"
    q.push("high-later", SHORT, 0.3, key="r-later", priority=-1)
    q.requeue("high", SHORT, 0.1, key="r-high", priority=-1)  # its replica failed: back, by arrival
    assert "r-high" in q and q.remove("r-low") == "low" and "r-low" not in q
    assert drain(q, 0.4) == ["high", "high-later"] and len(q) == 0


def test_best_priority_is_what_the_schedulers_hear_of():
    q = AdmissionQueue()
    assert q.best_priority() is None
    q.push("a", SHORT, 0.0, priority=2)
    q.push("b", LONG, 0.0, priority=-1)
    assert q.best_priority() == -1
    assert q.pop(0.0) == "b" and q.best_priority() == 2
