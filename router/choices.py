"""Several choices of one request (GenerateRequest.n): each is a request of its own to the scheduler, and
their streams are merged here into the client's one stream.

Choice i runs as internal request `id` (i = 0) or `id#i`, with seed + i when the request is seeded (vLLM's
rule), so choice i equals a request of n 1 with that seed. Choices after the first name it (fork_of): the
scheduler shares its prompt's KV blocks with them (scheduler/forks.py). They leave the router's queue one
after the other (same length bucket, in order); with several replicas one may land on another replica and
is then computed alone there. Each choice ends on its own (its own finish_reason, credit and metrics);
the merged stream's very last message carries the usage of all of them. Prompt logprobs are computed once,
by the first choice, and copied to every choice's first message.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

from common.pb.tpserve.v1 import generation_pb2

MAX_N = 16  # choices per request: each is a sequence in the batch


def choice_ids(request_id: str, n: int) -> list[str]:
    """The internal request id of each choice (the first keeps the client's)."""
    return [request_id] + [f"{request_id}#{i}" for i in range(1, n)]


def choice_seed(seed: int | None, index: int) -> int | None:
    return None if seed is None else (seed + index) % 2**64


async def merged(
    streams: list[AsyncIterator[generation_pb2.GenerateResponse]],
    prompt_logprobs: bool = False,
    same_prompt: bool = True,
    finishes: int | None = None,
) -> AsyncIterator[generation_pb2.GenerateResponse]:
    """The choices' responses as they come (each already carries its index). A choice's failure fails the
    whole request, and closing this closes every choice (which aborts those still running). The very
    last message (the `finishes`-th with a finish_reason; default one per stream) carries the usage of
    all: one prompt's tokens when every stream has the same prompt, else their sum.
    prompt_logprobs: the first choice's first message carries them; the others' wait for it."""
    finishes = len(streams) if finishes is None else finishes
    if len(streams) == 1 and finishes == 1:
        async with _closing(streams):
            async for resp in streams[0]:
                yield resp
        return
    queue: asyncio.Queue = asyncio.Queue()
    done = object()

    async def pump(stream) -> None:
        try:
            async for resp in stream:
                queue.put_nowait(resp)
            queue.put_nowait(done)
        except Exception as e:  # handed to the consumer, which raises it
            queue.put_nowait(e)

    tasks = [asyncio.create_task(pump(s)) for s in streams]
    totals = generation_pb2.Usage()
    finished = 0
    # Until choice 0's first message brings the prompt logprobs, the other choices' messages wait; from
    # then on each other choice's first message gets a copy, whenever it comes.
    held: list[generation_pb2.GenerateResponse] = []
    first_logprobs = None
    started = {0}
    remaining = len(streams)
    async with _closing(streams, tasks):
        while remaining:
            item = await queue.get()
            if item is done:
                remaining -= 1
                continue
            if isinstance(item, Exception):
                raise item
            ready = [item]
            if prompt_logprobs:
                if first_logprobs is None:
                    if item.index != 0:
                        held.append(item)
                        continue
                    first_logprobs, ready, held = list(item.prompt_logprobs), [item, *held], []
                for resp in ready:
                    if resp.index not in started:  # its first message
                        resp.prompt_logprobs.extend(first_logprobs)
                        started.add(resp.index)
            for resp in ready:
                if resp.finish_reason:
                    finished += 1
                    _add_usage(totals, resp.usage, same_prompt)
                    resp.ClearField("usage")
                    if finished == finishes:  # the very last message
                        resp.usage.CopyFrom(totals)
                yield resp


def _add_usage(totals: generation_pb2.Usage, u: generation_pb2.Usage, same_prompt: bool) -> None:
    # One prompt is one prompt whatever its choices; completions add up.
    if same_prompt:
        totals.prompt_tokens = max(totals.prompt_tokens, u.prompt_tokens)
        totals.cached_tokens = max(totals.cached_tokens, u.cached_tokens)
    else:
        totals.prompt_tokens += u.prompt_tokens
        totals.cached_tokens += u.cached_tokens
    totals.completion_tokens += u.completion_tokens
    totals.reasoning_tokens += u.reasoning_tokens


class _closing:
    """On exit: cancels the pumps, then closes every stream (a choice still running is aborted)."""

    def __init__(self, streams, tasks=()):
        self.streams, self.tasks = streams, tasks

    async def __aenter__(self):
        return self

    async def __aexit__(self, *exc):
        for t in self.tasks:
            t.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)
        for s in self.streams:
            await s.aclose()
