"""GetStats sums every scalar field of Stats through the descriptors (router/stats.py)."""

from common.pb.tpserve.v1 import generation_pb2
from router.stats import SUMMED, add_into


def test_every_scalar_field_is_summed_and_nothing_else():
    scalar = [
        f.name
        for f in generation_pb2.Stats.DESCRIPTOR.fields
        if f.type != f.TYPE_MESSAGE and not f.is_repeated
    ]
    assert set(SUMMED) == set(scalar) and "buckets" not in SUMMED and "replicas" not in SUMMED
    part = generation_pb2.Stats(**{name: 2 for name in SUMMED})
    total = generation_pb2.Stats()
    add_into(total, part)
    add_into(total, part)
    assert all(getattr(total, name) == 4 for name in SUMMED)


def test_repeated_counters_are_summed_element_by_element():
    """Speculative decoding's acceptance per position, from replicas proposing different lengths."""
    total = generation_pb2.Stats()
    add_into(total, generation_pb2.Stats(spec_accepted_per_position_total=[5, 3]))
    add_into(total, generation_pb2.Stats(spec_accepted_per_position_total=[1, 1, 1, 1]))
    assert list(total.spec_accepted_per_position_total) == [6, 4, 1, 1]
