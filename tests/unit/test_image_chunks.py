"""Chunked prefill never splits an image's placeholders (scheduler/images.py), and a replica refuses an
image that no step could hold. Plain Python."""

from common.block_hash import ImageSpan
from common.pb.tpserve.internal.v1 import scheduler_pb2
from scheduler import images
from scheduler.add_request import RequestError, sequence_for
from scheduler.scheduler import SchedulingPolicy
from scheduler.sequence import Sequence
from tests.unit.test_scheduler import make, run_to_completion, seq


def test_limit_cuts_a_chunk_before_an_image_or_takes_it_whole():
    s = Sequence(0, "r", [1] * 100, 100, 4, images=(ImageSpan(10, 20, b"a"), ImageSpan(50, 5, b"b")))
    assert images.limit(s, 15, 0) == 10  # would end inside the first image: ends before it
    assert images.limit(s, 30, 0) == 30  # ends exactly where it ends
    assert images.limit(s, 52, 0) == 50  # the second image would be split
    assert images.limit(s, 5, 10) == 0  # starts at the image with room for part of it: waits
    # The rest of an image whose first blocks came from the prefix cache: whole or none.
    assert images.limit(s, 5, 20) == 0 and images.limit(s, 10, 20) == 10 and images.limit(s, 12, 20) == 12
    assert images.limit(Sequence(1, "t", [1] * 9, 9, 4), 5, 2) == 5  # no images: untouched


def test_chunks_never_split_an_image_and_the_outputs_equal_unchunked():
    spans = (ImageSpan(20, 40, b"a"), ImageSpan(70, 30, b"b"))

    def go(budget):
        sched = make(SchedulingPolicy(max_num_batched_tokens=budget, max_model_len=1024))
        for i in range(3):
            sched.add(seq(i, 120, max_new=5, images=spans))
        ends = []
        real_schedule = sched.schedule

        def schedule(*args):  # each chunk's end, as planned (before the step's update moves it)
            out = real_schedule(*args)
            ends.extend(s.seq.num_computed_tokens + s.num_new_tokens for s in out.scheduled)
            return out

        sched.schedule = schedule
        outputs, steps = run_to_completion(sched)
        assert all(step.num_batched_tokens <= budget for step in steps)
        assert any(end < 120 for end in ends) or budget > 360  # it did chunk
        assert not [e for e in ends if any(im.offset < e < im.offset + im.length for im in spans)]
        return outputs

    assert go(48) == go(64) == go(4096)


def test_a_replica_refuses_an_image_longer_than_the_step_budget():
    sched = make(SchedulingPolicy(max_num_batched_tokens=64, max_model_len=1024))
    add = scheduler_pb2.AddRequest(
        request_id="x", prompt_token_ids=[5] * 100, images=[scheduler_pb2.PromptImage(offset=5, length=65)]
    )
    try:
        sequence_for(add, sched, 0, ())
        raise AssertionError("accepted")
    except RequestError as e:
        assert e.code == scheduler_pb2.ERROR_CODE_INVALID_ARGUMENT and "--max-num-batched-tokens 64" in str(e)
    add.images[0].length = 64
    assert sequence_for(add, sched, 0, ()).images == (ImageSpan(5, 64, b""),)
