"""A router's AddRequest checked against this replica and turned into a Sequence (Engine.add), or refused
with the error code the router turns into the client's status.

Plain Python beside the generated messages: no torch, no gRPC.
"""

from __future__ import annotations

import time
from collections.abc import Container

from common.pb.tpserve.internal.v1 import scheduler_pb2
from common.pb.tpserve.internal.v1.scheduler_pb2 import (
    ERROR_CODE_ALREADY_EXISTS,
    ERROR_CODE_INVALID_ARGUMENT,
    ERROR_CODE_NOT_FOUND,
    ERROR_CODE_UNAVAILABLE,
)
from scheduler import images
from scheduler.scheduler import Scheduler
from scheduler.sequence import Sequence, from_request


class RequestError(Exception):
    """A request this scheduler refuses; travels back to the router as its RequestOutput's error."""

    def __init__(self, code: int, message: str):
        super().__init__(message)
        self.code = code  # a scheduler_pb2.ErrorCode


def sequence_for(
    msg: scheduler_pb2.AddRequest, scheduler: Scheduler | None, seq_id: int, lora_names: Container[str]
) -> Sequence:
    """The request as sequence seq_id; RequestError when this replica refuses it. lora_names: the LoRA
    adapters it serves."""
    # Shards lost after they were ready do not refuse a request that was already on its way: it waits
    # with the others for them to return (or for worker_recovery_timeout_s, then UNAVAILABLE).
    if scheduler is None:
        raise RequestError(ERROR_CODE_UNAVAILABLE, "shard workers are not ready")
    if scheduler.has_request(msg.request_id):
        raise RequestError(ERROR_CODE_ALREADY_EXISTS, f"request_id {msg.request_id!r} is in flight")
    if msg.lora_name and msg.lora_name not in lora_names:
        raise RequestError(ERROR_CODE_NOT_FOUND, f"LoRA adapter {msg.lora_name!r} is not served here")
    if msg.num_output_tokens >= len(msg.prompt_token_ids):
        raise RequestError(
            ERROR_CODE_INVALID_ARGUMENT,
            f"num_output_tokens {msg.num_output_tokens} leaves no prompt in "
            f"{len(msg.prompt_token_ids)} tokens",
        )
    reason = images.too_long([im.length for im in msg.images], scheduler.policy.max_num_batched_tokens)
    if reason is not None:
        raise RequestError(ERROR_CODE_INVALID_ARGUMENT, reason)
    # Another choice of the same request, with the same prompt, whose prompt blocks this one shares.
    first = scheduler.get(msg.fork_of) if msg.fork_of else None
    if first is not None and first.token_ids[: first.num_prompt_tokens] != list(msg.prompt_token_ids):
        first = None
    return from_request(msg, seq_id, time.monotonic(), first)
