"""The router's shared request path (router/frontend.py) without processes: prompts are tokenized and output
text is decoded off the event loop, so one huge prompt or a burst of top_logprobs does not stall every other
stream meanwhile."""

from __future__ import annotations

import asyncio
import threading
import types

import grpc
import pytest

from common.pb.tpserve.internal.v1 import scheduler_pb2
from common.pb.tpserve.v1 import generation_pb2 as pb
from router.config import RouterConfig
from router.frontend import Frontend, RequestFailed
from router.metrics import RouterMetrics
from router.tokenizer import Tokenizer


class RecordingTokenizer:
    """A stand-in for a Hugging Face tokenizer that notes which thread encodes."""

    chat_template = "{{ messages }}"

    def __init__(self):
        self.threads: list[int] = []
        self.decode_threads: list[int] = []

    def __call__(self, text, add_special_tokens=True):
        self.threads.append(threading.get_ident())
        return {"input_ids": [5] * len(text.split())}

    def apply_chat_template(self, messages, tokenize, **options):
        return " ".join(m["content"] for m in messages)

    def decode(self, ids, **kwargs):
        self.decode_threads.append(threading.get_ident())
        return "".join(f"<{i}>" for i in ids)

    def batch_decode(self, batch):
        self.decode_threads.append(threading.get_ident())
        return [self.decode(ids) for ids in batch]


class ScriptedPool:
    """The pool's surface as the Frontend uses it: every request gets the same scripted outputs."""

    def __init__(self, outputs):
        self.model_info = pb.ModelInfo(model_name="m", vocab_size=100, max_model_len=64, block_size=16)
        self.accepting = True
        self.outputs = outputs

    def in_flight(self, request_id):
        return False

    def submit(self, add, objectives=None):
        queue = asyncio.Queue()
        for out in self.outputs:
            queue.put_nowait(
                scheduler_pb2.RequestOutput(request_id=add.request_id).__class__.FromString(
                    out.SerializeToString()
                )
            )
        return queue

    def done(self, request_id):
        pass

    def abort(self, request_id):
        pass


def frontend(hf, pool=None) -> Frontend:
    info = pb.ModelInfo(model_name="m", vocab_size=100, max_model_len=64, block_size=16)
    pool = pool or types.SimpleNamespace(model_info=info, accepting=True)
    config = RouterConfig(model="/nonexistent", schedulers=("h:1",))
    return Frontend(config, Tokenizer(hf), pool, RouterMetrics())


def test_text_and_chat_prompts_are_encoded_off_the_event_loop():
    hf = RecordingTokenizer()
    fe = frontend(hf)

    async def validate_both():
        loop_thread = threading.get_ident()
        text = await fe._validate(pb.GenerateRequest(text="a b c", max_new_tokens=4))
        chat = await fe._validate(
            pb.GenerateRequest(messages=[pb.ChatMessage(role="user", content="x y")], max_new_tokens=4)
        )
        return loop_thread, text, chat

    loop_thread, text, chat = asyncio.run(validate_both())
    assert text.prompt_token_ids == (5, 5, 5) and chat.prompt_token_ids == (5, 5)
    assert len(hf.threads) == 2 and loop_thread not in hf.threads


def top(token_id, k=20):
    return pb.Logprobs(
        chosen=pb.TokenLogprob(token_id=token_id, logprob=-1.0),
        top=[pb.TokenLogprob(token_id=t, logprob=-2.0) for t in range(k)],
    )


def test_output_text_and_logprob_texts_are_decoded_off_the_event_loop_in_batches():
    """The bug: the Frontend decoded every token (21 times with top_logprobs 20) on its event loop."""
    outputs = [
        scheduler_pb2.RequestOutput(token_ids=[7], logprobs=[top(7)]),
        scheduler_pb2.RequestOutput(token_ids=[8], logprobs=[top(8)]),
        scheduler_pb2.RequestOutput(token_ids=[9], logprobs=[top(9)], finish_reason=pb.FINISH_REASON_LENGTH),
    ]
    hf = RecordingTokenizer()
    fe = frontend(hf, ScriptedPool(outputs))

    async def run_many(n):
        async def one(i):
            req = pb.GenerateRequest(request_id=f"r{i}", token_ids=[1, 2], max_new_tokens=3, top_logprobs=20)
            return [resp async for resp in fe.generate(req)]

        return threading.get_ident(), await asyncio.gather(*(one(i) for i in range(n)))

    loop_thread, answers = asyncio.run(run_many(8))
    assert hf.decode_threads and loop_thread not in hf.decode_threads
    for responses in answers:
        assert "".join(r.text for r in responses) == "<7><8><9>"
        lp = responses[0].logprobs[0]
        assert lp.chosen.text == "<7>" and [t.text for t in lp.top[:2]] == ["<0>", "<1>"]
    # Eight requests' three messages each: far fewer hand-offs to the decode thread than decodes.
    assert fe.tokenizer.decoding.batches < 8 * 4


class RecordingPool(ScriptedPool):
    """Notes every AddRequest and abort; each choice gets the outputs scripted for its index."""

    def __init__(self, outputs_by_choice, hold: set[int] = frozenset()):
        super().__init__([])
        self.by_choice, self.hold = outputs_by_choice, hold
        self.adds, self.aborted = [], []

    def submit(self, add, objectives=None):
        index = len(self.adds)
        self.adds.append(add)
        queue = asyncio.Queue()
        if index not in self.hold:  # a held choice never answers: it is aborted when the call ends
            for out in self.by_choice[index]:
                queue.put_nowait(scheduler_pb2.RequestOutput.FromString(out.SerializeToString()))
        return queue

    def abort(self, request_id):
        self.aborted.append(request_id)


def test_n_choices_run_as_forks_with_derived_seeds_and_merge_into_one_stream():
    hf = RecordingTokenizer()
    lp = pb.Logprobs(chosen=pb.TokenLogprob(token_id=7, logprob=-1.0, rank=3))
    outs = [
        [
            scheduler_pb2.RequestOutput(prompt_logprobs=[lp] if i == 0 else []),
            scheduler_pb2.RequestOutput(token_ids=[10 + i]),
            scheduler_pb2.RequestOutput(token_ids=[20 + i], finish_reason=pb.FINISH_REASON_LENGTH),
        ]
        for i in range(3)
    ]
    pool = RecordingPool(outs)
    req = pb.GenerateRequest(
        request_id="r", token_ids=[5, 7], max_new_tokens=2, n=3, prompt_logprobs=0,
        sampling=pb.SamplingParams(temperature=1.0, seed=41),
    )  # fmt: skip

    async def run():
        return [r async for r in frontend(hf, pool).generate(req)]

    got = asyncio.run(run())
    assert [a.request_id for a in pool.adds] == ["r", "r#1", "r#2"]
    assert [a.sampling.seed for a in pool.adds] == [41, 42, 43]
    assert [a.fork_of for a in pool.adds] == ["", "r", "r"]
    assert [a.want_prompt_logprobs for a in pool.adds] == [True, False, False]
    tokens = {i: [t for r in got if r.index == i for t in r.token_ids] for i in range(3)}
    assert tokens == {0: [10, 20], 1: [11, 21], 2: [12, 22]}
    # Every choice's first message has the prompt's logprobs: the first token's (id only), then 7's.
    firsts = [next(r for r in got if r.index == i) for i in range(3)]
    assert all([p.chosen.token_id for p in f.prompt_logprobs] == [5, 7] for f in firsts)
    # Only the very last message carries the usage, summed over the choices.
    with_usage = [r for r in got if r.HasField("usage")]
    assert with_usage == [got[-1]] and got[-1].usage.completion_tokens == 6
    assert sum(1 for r in got if r.finish_reason) == 3 and pool.aborted == []


def test_a_choice_that_fails_ends_the_request_and_aborts_the_others():
    hf = RecordingTokenizer()
    failing = [scheduler_pb2.RequestOutput(error="boom", error_code=scheduler_pb2.ERROR_CODE_INTERNAL)]
    pool = RecordingPool([[], failing], hold={0})
    req = pb.GenerateRequest(request_id="r", token_ids=[5], max_new_tokens=2, n=2)

    async def run():
        async for _ in frontend(hf, pool).generate(req):
            pass

    with pytest.raises(RequestFailed) as failed:
        asyncio.run(run())
    # The client gets the failed choice's error, with its status; the held choice is aborted (the failed
    # one ended itself).
    assert failed.value.code == grpc.StatusCode.INTERNAL and failed.value.message == "boom"
    assert pool.aborted == ["r"]


def test_a_full_queue_at_a_later_choice_aborts_the_choices_already_submitted():
    from router.scheduler_link import QueueFull

    class FullAtSecond(RecordingPool):
        def submit(self, add, objectives=None):
            if len(self.adds) == 1:
                raise QueueFull("queue full")
            return super().submit(add)

    pool = FullAtSecond([[], []], hold={0})
    req = pb.GenerateRequest(request_id="r", token_ids=[5], max_new_tokens=2, n=2)

    async def run():
        async for _ in frontend(RecordingTokenizer(), pool).generate(req):
            pass

    with pytest.raises(RequestFailed) as failed:
        asyncio.run(run())
    # The client is told the queue is full (RESOURCE_EXHAUSTED); the choice already submitted is aborted.
    assert failed.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert failed.value.message.startswith("queue full")
    assert [a.request_id for a in pool.adds] == ["r"] and pool.aborted == ["r"]


def test_a_choice_whose_first_message_comes_after_choice_0s_still_gets_the_prompt_logprobs():
    from router.choices import merged

    lp = pb.Logprobs(chosen=pb.TokenLogprob(token_id=7, logprob=-1.0, rank=3))
    first_sent = asyncio.Event()

    async def choice0():
        yield pb.GenerateResponse(index=0, prompt_logprobs=[lp], token_ids=[1])
        first_sent.set()
        yield pb.GenerateResponse(index=0, token_ids=[2], finish_reason=pb.FINISH_REASON_LENGTH)

    async def choice1():  # the fork runs after the first choice: its first message comes later
        await first_sent.wait()
        yield pb.GenerateResponse(index=1, token_ids=[3])
        yield pb.GenerateResponse(index=1, token_ids=[4], finish_reason=pb.FINISH_REASON_LENGTH)

    async def run():
        return [r async for r in merged([choice0(), choice1()], prompt_logprobs=True)]

    got = asyncio.run(run())
    firsts = [next(r for r in got if r.index == i) for i in range(2)]
    assert [[p.chosen.token_id for p in f.prompt_logprobs] for f in firsts] == [[7], [7]]
    assert all(not r.prompt_logprobs for r in got if r not in firsts)
