"""GetStats across the replicas: every scheduler is asked, the numeric fields of their answers are summed,
and each replica gets a ReplicaStats entry with the router's view of it.

The sum walks the Stats message's descriptor, so a counter added to the proto is summed without this
file knowing its name; repeated and message fields (buckets, replicas) are the router's to fill.
"""

from __future__ import annotations

import asyncio
import time

import grpc
from google.protobuf.descriptor import FieldDescriptor

from common.pb.tpserve.v1 import generation_pb2
from router.replicas import ReplicaSet

# Fields of ReplicaStats copied from the replica's own Stats when it answers.
_PER_REPLICA = (
    "num_running",
    "num_waiting",
    "kv_blocks_total",
    "kv_blocks_free",
    "num_steps_total",
    "batched_tokens_total",
)


def _summable(field: FieldDescriptor) -> bool:
    return field.type != FieldDescriptor.TYPE_MESSAGE and not field.is_repeated


SUMMED = tuple(f.name for f in generation_pb2.Stats.DESCRIPTOR.fields if _summable(f))
# Repeated counters (per position), summed element by element.
SUMMED_LISTS = tuple(
    f.name for f in generation_pb2.Stats.DESCRIPTOR.fields if f.is_repeated and f.type != f.TYPE_MESSAGE
)


def add_into(total: generation_pb2.Stats, part: generation_pb2.Stats) -> None:
    """total += part, field by field, for every scalar field of Stats (and repeated counters, element by
    element)."""
    for name in SUMMED:
        setattr(total, name, getattr(total, name) + getattr(part, name))
    for name in SUMMED_LISTS:
        into, more = getattr(total, name), getattr(part, name)
        into.extend([0] * (len(more) - len(into)))
        for i, value in enumerate(more):
            into[i] += value


async def gather_stats(
    stubs: dict, replicas: ReplicaSet, timeout_s: float = 5.0
) -> generation_pb2.Stats | None:
    """Sums over the replicas whose scheduler answers (stubs: replica -> its Scheduler stub), with one
    ReplicaStats each; None when none answered."""
    targets = list(stubs)

    async def ask(target):
        try:
            return await stubs[target].GetStats(generation_pb2.StatsRequest(), timeout=timeout_s)
        except grpc.RpcError:
            return None

    answers = dict(zip(targets, await asyncio.gather(*(ask(t) for t in targets)), strict=True))
    if all(a is None for a in answers.values()):
        return None
    total = generation_pb2.Stats()
    for s in answers.values():
        if s is not None:
            add_into(total, s)
    for r in replicas.stats(time.monotonic()):
        if r.replica not in answers:
            continue
        s = answers[r.replica]
        entry = total.replicas.add(
            replica=r.replica,
            up=r.up,
            down_reason=r.reason,
            report_age_seconds=r.report_age_s if r.load is not None else -1.0,
            routed_total=r.routed_total,
            pending=r.pending,
            headroom=r.headroom if r.up else 0.0,
            stats_answered=s is not None,
            cache_hit_tokens_total=r.cache_hit_tokens_total,
            cached_blocks=r.cached_blocks,
            cache_index_dropped_total=r.index_dropped_total,
        )
        if s is not None:
            for name in _PER_REPLICA:
                setattr(entry, name, getattr(s, name))
        elif r.load is not None:
            entry.num_running, entry.num_waiting = r.load.running, r.load.waiting
            entry.kv_blocks_total, entry.kv_blocks_free = r.load.kv_blocks_total, r.load.kv_blocks_free
    return total
