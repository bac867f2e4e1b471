"""The scheduler's admission window shared among several routers (scheduler/router_streams.py
split_window): by what each router's queue needs, its priority and how long it waited, never more in
total than the scheduler has room for. Pure logic."""

from scheduler.router_streams import RouterStream, RouterStreams, RouterWant, split_window


def test_the_admission_window_is_split_among_routers_by_what_they_queue():
    def split(window, queued, floors, **kw):
        return split_window(window, [RouterWant(q, f, **kw) for q, f in zip(queued, floors, strict=True)])

    assert split(8, [0], [3]) == [8]  # one router: the whole window, as before
    assert split(4, [10, 10], [0, 0]) == [2, 2]
    assert split(6, [1, 0, 0], [0, 0, 0]) == [1, 0, 0]  # nothing for routers with nothing queued
    assert split(4, [10, 10], [3, 0]) == [3, 1]  # what may be on the wire is never taken back
    assert split(2, [10, 10], [3, 0]) == [3, 0]
    assert split(0, [5, 5], [0, 0]) == [0, 0]
    for window in range(12):
        for queued, floors in (([0, 0, 0], [0, 0, 0]), ([1, 7, 2], [0, 2, 1]), ([30, 0, 1, 4], [1, 1, 0, 0])):
            shares = split(window, queued, floors)
            assert all(s >= f for s, f in zip(shares, floors, strict=True))
            assert sum(shares) <= max(window, sum(floors))
            if sum(max(0, q - f) for q, f in zip(queued, floors, strict=True)) >= window - sum(floors):
                assert sum(shares) == max(window, sum(floors))  # demand exceeds it: all of it given


def test_a_router_with_a_short_queue_gets_its_share_of_the_window():
    """Each router's share is levelled, not in proportion to its queue: dividing by queue length gave
    (1, [1, 5]) -> [0, 1], and the router holding one request waited behind all five of the other's."""
    assert split_window(1, [RouterWant(1), RouterWant(5)]) == [1, 0]  # ties: the shorter queue first
    assert split_window(4, [RouterWant(1), RouterWant(24)]) == [1, 3]
    assert split_window(4, [RouterWant(2), RouterWant(24)]) == [2, 2]
    # At a window of one, the router that waited longer takes the seat: the two take turns.
    assert split_window(1, [RouterWant(24, waited_s=0.0), RouterWant(2, waited_s=0.3)]) == [0, 1]
    assert split_window(1, [RouterWant(24, waited_s=0.3), RouterWant(2, waited_s=0.0)]) == [1, 0]
    # Among equal shares, the router whose best request has the higher priority (lower value) first.
    assert split_window(1, [RouterWant(1, priority=5, waited_s=9.0), RouterWant(1, priority=0)]) == [0, 1]


def test_places_taken_by_preemption_go_only_to_the_router_whose_request_outranks_the_running_ones():
    """The scheduler's priority credit (places of running sequences of lower priority) once went to the
    split like free slots: a router holding only low-priority requests could take it, and they filled
    the scheduler's queue ahead of the high one, preempting nobody."""
    low, high = RouterWant(10, priority=5, preempts=0), RouterWant(10, priority=-1, preempts=2)
    assert split_window(0, [low, high]) == [0, 2]
    assert split_window(2, [low, high]) == [2, 2]  # and the free slots levelled over both
    # The same running sequences: what the better router takes, the next cannot take again.
    mid = RouterWant(10, priority=0, preempts=1)
    assert split_window(0, [mid, RouterWant(1, priority=-1, preempts=2)]) == [0, 1]  # the lowest one
    assert split_window(
        0, [RouterWant(10, priority=0, preempts=2), RouterWant(1, priority=-1, preempts=3)]
    ) == [
        1,
        1,
    ]
    assert split_window(0, [mid, high]) == [0, 2]
    for window in range(6):
        shares = split_window(window, [low, mid, high])
        assert sum(shares) <= window + 2  # never more than the free slots and the places preemption makes


def test_the_scheduler_splits_its_window_by_each_routers_priority():
    """RouterStreams.shares asks the scheduler what each router's best priority would take, and a
    router that waited without credit moves ahead of one just served."""
    routers = RouterStreams()
    a, b = RouterStream(), RouterStream()
    routers.attach(a)
    routers.attach(b)
    a.queued, a.best_priority = 24, 5
    b.queued, b.best_priority = 2, -1

    def window_for(priority):  # one free slot; a priority below 0 outranks two running sequences
        return 1 + (2 if priority is not None and priority < 0 else 0)

    shares = routers.shares(window_for, now=0.0)
    assert (shares[a], shares[b]) == (1, 2)  # b's two by preemption, the free slot to a
    b.queued, b.best_priority = 0, None
    assert routers.shares(lambda p: 1, now=1.0)[a] == 1
