"""Small jobs run off the event loop, batched: what the router decodes for every streamed token.

A step's tokens reach the router for many requests at once, and each request's text needs a decode (more
with logprobs: one per alternative). Decoding on the event loop would delay every other stream and the
gRPC and HTTP servers with it; one executor call per token would cost more loop time in wake-ups than the
decode itself. So jobs submitted in the same loop iteration go to the worker thread as one batch, and jobs
submitted while a batch runs form the next one: one hand-off per batch, however many requests it holds.

Jobs of one batch run in submission order on one thread. A request awaits each of its jobs before it
submits the next, so its own jobs never overlap (a TextStream needs no lock).
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Callable
from concurrent.futures import Executor
from typing import Any

Job = tuple[Callable[[], Any], asyncio.Future]


def _run_batch(batch: list[Job]) -> list[tuple[bool, Any]]:
    """On the worker thread: each job's (ok, result or exception); one failure is only its job's."""
    results = []
    for fn, _ in batch:
        try:
            results.append((True, fn()))
        except Exception as e:  # handed to the job's awaiter
            results.append((False, e))
    return results


class OffLoop:
    def __init__(self, executor: Executor):
        self._executor = executor
        self._pending: list[Job] = []
        self._running = False
        self.batches = 0  # executor hand-offs so far (tests, and the figure that batching saves)

    async def run(self, fn: Callable[..., Any], *args, **kwargs) -> Any:
        """fn(*args, **kwargs) on the worker thread, batched with the jobs submitted around it."""
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        self._pending.append((functools.partial(fn, *args, **kwargs), future))
        if not self._running:
            self._running = True
            # Not at once: the other requests woken by the same step add their jobs in this iteration.
            loop.call_soon(self._launch, loop)
        return await future

    def _launch(self, loop: asyncio.AbstractEventLoop) -> None:
        batch, self._pending = self._pending, []
        self.batches += 1
        done = loop.run_in_executor(self._executor, _run_batch, batch)
        done.add_done_callback(lambda f: self._finish(loop, batch, f))

    def _finish(self, loop: asyncio.AbstractEventLoop, batch: list[Job], done: asyncio.Future) -> None:
        if done.cancelled() or done.exception() is not None:  # the executor shut down
            error = done.exception() if not done.cancelled() else RuntimeError("the decode thread stopped")
            results = [(False, error)] * len(batch)
        else:
            results = done.result()
        for (_, future), (ok, value) in zip(batch, results, strict=True):
            if future.done():  # its request was cancelled meanwhile (the client went away)
                continue
            if ok:
                future.set_result(value)
            else:
                future.set_exception(value)
        if self._pending:
            self._launch(loop)
        else:
            self._running = False
