"""vLLM's /tokenize and /detokenize, in its request and response shapes:

    POST /tokenize {"prompt": str, "add_special_tokens": true, "return_token_strs": false}
              or   {"messages": [...], "add_generation_prompt": true, "continue_final_message": false,
                    "add_special_tokens": false, "tools": [...], "return_token_strs": false}
      -> {"count": int, "max_model_len": int, "tokens": [int], "token_strs": [str] | null}
    POST /detokenize {"tokens": [int]} -> {"prompt": str}

A chat body is rendered exactly as /v1/chat/completions renders it (the same GenerateRequest fields), so a
client can count a conversation's tokens before it sends it.
"""

from __future__ import annotations

from dataclasses import dataclass

from common.pb.tpserve.v1 import generation_pb2 as pb
from router.openai import fields as f
from router.openai.errors import bad_request
from router.openai.protocol import parse_message
from router.openai.tools import parse_tools

TOKENIZE_FIELDS = {
    "model", "prompt", "messages", "add_special_tokens", "add_generation_prompt", "continue_final_message",
    "tools", "return_token_strs",
}  # fmt: skip
CHAT_ONLY = ("add_generation_prompt", "continue_final_message", "tools")


@dataclass(frozen=True)
class TokenizeRequest:
    model: str | None
    generate: pb.GenerateRequest  # the prompt fields only
    return_token_strs: bool


def _object(body: object, allowed: set[str]) -> dict:
    if not isinstance(body, dict):
        raise bad_request(None, f"the request body must be a JSON object, got {f.kind(body)}")
    for name in body:
        if name not in allowed:
            raise bad_request(name, f"unrecognized request field {name!r}")
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise bad_request("model", f"model must be a string, got {f.kind(model)}")
    return body


def parse_tokenize(body: object) -> TokenizeRequest:
    body = _object(body, TOKENIZE_FIELDS)
    kwargs = {}
    if body.get("add_special_tokens") is not None:
        kwargs["add_special_tokens"] = f.boolean(body, "add_special_tokens")
    if "messages" in body:
        messages = body["messages"]
        if not isinstance(messages, list) or not messages or "prompt" in body:
            raise bad_request("messages", "give prompt (a string) or messages (a non-empty array), not both")
        kwargs["messages"] = [parse_message(m, f"messages[{i}]") for i, m in enumerate(messages)]
        kwargs["tools"] = parse_tools(body)
        if body.get("add_generation_prompt") is not None:
            kwargs["add_generation_prompt"] = f.boolean(body, "add_generation_prompt")
        kwargs["continue_final_message"] = f.boolean(body, "continue_final_message")
    else:
        if not isinstance(body.get("prompt"), str):
            raise bad_request("prompt", "prompt must be a string (or send messages)")
        for name in CHAT_ONLY:
            if name in body:
                raise bad_request(name, f"{name} applies to messages only")
        kwargs["text"] = body["prompt"]
    return TokenizeRequest(
        model=body.get("model"),
        generate=pb.GenerateRequest(**kwargs),
        return_token_strs=f.boolean(body, "return_token_strs"),
    )


def parse_detokenize(body: object) -> tuple[str | None, list[int]]:
    body = _object(body, {"model", "tokens"})
    if not isinstance(body.get("tokens"), list):
        raise bad_request("tokens", "tokens must be an array of token ids")
    return body.get("model"), f.token_ids(body, "tokens")


def tokenize_response(ids: list[int], max_model_len: int, token_strs: list[str] | None) -> dict:
    return {"count": len(ids), "max_model_len": max_model_len, "tokens": ids, "token_strs": token_strs}
