"""The router's shared request path (router/frontend.py) without processes: prompts are tokenized and output
text is decoded off the event loop, so one huge prompt or a burst of top_logprobs does not stall every other
stream meanwhile."""

from __future__ import annotations

import asyncio
import threading
import types

from common.pb.tpserve.internal.v1 import scheduler_pb2
from common.pb.tpserve.v1 import generation_pb2 as pb
from router.config import RouterConfig
from router.frontend import Frontend
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

    def submit(self, add):
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
