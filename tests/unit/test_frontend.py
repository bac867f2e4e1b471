"""The router's shared request path (router/frontend.py) without processes: prompts are tokenized off the
event loop, so one huge prompt does not stall every other stream while it is encoded."""

from __future__ import annotations

import asyncio
import threading
import types

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

    def __call__(self, text, add_special_tokens=True):
        self.threads.append(threading.get_ident())
        return {"input_ids": [5] * len(text.split())}

    def apply_chat_template(self, messages, add_generation_prompt, tokenize):
        return " ".join(m["content"] for m in messages)

    def decode(self, ids, **kwargs):
        return ""


def frontend(hf) -> Frontend:
    info = pb.ModelInfo(model_name="m", vocab_size=100, max_model_len=64, block_size=16)
    pool = types.SimpleNamespace(model_info=info, accepting=True)
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
