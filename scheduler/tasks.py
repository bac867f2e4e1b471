"""The scheduler's tasks, supervised: none may fail unseen.

The step loop, the recovery expiry and the load reports each read and change the engine's state (the
sequences, the block pool, the routers' credit). One of them failing is a bug whose damage is unknown:
restarting it in place could stream a token twice or never, so the whole process ends, loudly (the
traceback, exit 1), and the launcher or Kubernetes restarts it; the routers hold every token they
streamed and resume the requests in flight. A silent stop is the one outcome that is never right (a
heartbeat that stops makes the routers take a live replica for dead). Tasks that only tidy (dropping an
unloaded adapter from the ranks) are idempotent and retried by their next trigger: their failures are
logged (log_failure) rather than fatal.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Coroutine

log = logging.getLogger("tpserve.scheduler")


class TaskEnded(RuntimeError):
    """A task that runs for the process's life returned."""


async def first_to_end(coros: dict[str, Coroutine]) -> str:
    """Runs the coroutines as tasks until the first ends; cancels the others and waits for them. Returns
    that one's name if it returned; if it raised, re-raises its exception, noted with its name."""
    tasks = {asyncio.create_task(coro, name=name): name for name, coro in coros.items()}
    try:
        done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
        task = next(iter(done))
        error = None if task.cancelled() else task.exception()
        if error is not None:
            error.add_note(f"(in the scheduler's {tasks[task]} task)")
            raise error
        return tasks[task]
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


def log_failure(task: asyncio.Task) -> None:
    """A done callback for a task whose failure is not fatal: its exception is logged, never lost."""
    if not task.cancelled() and task.exception() is not None:
        log.error("scheduler task %s failed", task.get_name(), exc_info=task.exception())
