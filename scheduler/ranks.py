"""The engine's side of its ranks (scheduler/workers.py): connecting them (the capacity they agree on
becomes the block pools, the Scheduler and the model info; adapters loaded while serving are restored),
a rank lost (its peers' caches are useless too: every request is requeued for recompute, and kept here
until the ranks are back or the recovery clock, scheduler/recovery.py, ends it), ranks back unfit to
serve (the requests in flight end with UNAVAILABLE), and the readiness the health service and the routers
follow. Engine (scheduler/engine.py) inherits it.
"""

from __future__ import annotations

import asyncio
import logging
import time

from common.pb.tpserve.internal.v1.scheduler_pb2 import ERROR_CODE_NOT_FOUND, ERROR_CODE_UNAVAILABLE
from scheduler.block_manager import BlockManager
from scheduler.capacity import UnfitRanks
from scheduler.reports import model_info
from scheduler.router_streams import speed_of
from scheduler.scheduler import Scheduler
from scheduler.swap import HostBlockPool
from scheduler.workers import WorkersLost

log = logging.getLogger("tpserve.scheduler")

# How long a scheduler whose ranks came back unfit to serve waits before it asks them again.
UNFIT_RETRY_S = 5.0
# How long after a lost rank before the ranks are connected again (a poisonous step must not spin).
LOST_RETRY_S = 1.0


class RankLifecycle:
    async def _steps(self) -> None:
        """Connects the ranks and runs the step loop; a rank lost or ranks back unfit are dealt with and
        the ranks connected again, for the engine's life."""
        while True:
            try:
                await self._connect()
                await self._run()
            except WorkersLost as e:  # MalformedReply too: a rank that answered nonsense
                await self._workers_lost(e)
                # A rank that fails the same step again and again (a poisonous request) must not
                # spin: back off; the recovery clock keeps running until a step succeeds.
                await asyncio.sleep(LOST_RETRY_S)
            except UnfitRanks as e:  # only these: any other error is a bug, and is not disguised
                if self.scheduler is None:
                    raise  # at start-up: a misconfiguration, one line and exit 2
                await self._unfit_ranks(e)
                await asyncio.sleep(UNFIT_RETRY_S)

    async def _connect(self) -> None:
        info = await self.workers.connect(self._wakeup.set)
        cfg, cap, first = self.config, info.capacity, info.describe[0]
        if cfg.speculative.speculative_method == "draft" and not all(
            i.draft_model_name for i in info.describe
        ):
            raise UnfitRanks("--speculative-method draft: the shard workers hold no --speculative-model")
        if cap.state is not None and cfg.speculative.enabled:
            raise UnfitRanks(
                f"--speculative-method {cfg.speculative.speculative_method}: the model has linear-attention "
                "layers, whose state cannot take back rejected proposals; serve it without speculation"
            )
        host_blocks = None
        if cap.num_host_blocks:
            host_blocks = HostBlockPool(cap.num_host_blocks, cache_prefixes=cfg.host_prefix_cache)
        blocks = BlockManager.of(cap, cfg.block_size, cfg.enable_prefix_caching, host_blocks)
        if cfg.swap_space:
            tier = ", shared with the prefix cache's host tier" if cfg.host_prefix_cache else ""
            gib = cfg.swap_space
            level = logging.INFO if cap.num_host_blocks else logging.WARNING  # 0: no swapping, no host tier
            log.log(level, "swap space: %d host blocks per rank (%.2f GiB)%s", cap.num_host_blocks, gib, tier)
        if self.scheduler is None:
            policy = cfg.resolved_policy(cap.max_model_len)
            self.scheduler = Scheduler(policy, blocks, first.eos_token_ids, host_blocks, self.speculator)
        else:  # the ranks came back: same requests, fresh caches (and maybe another capacity)
            too_long = self.scheduler.replace_blocks(blocks, host_blocks, cap.max_model_len)
            self._fail(
                [s.request_id for s in too_long],
                ERROR_CODE_UNAVAILABLE,
                f"the replica's ranks came back holding at most {cap.max_model_len} tokens per sequence, "
                "fewer than the request needs",
            )
        self.model_info = model_info(first, cap.max_model_len, len(info.describe), cfg.block_size)
        self.routers.speed = speed_of(info.describe)  # sent with model_info
        self._builder.forget_all()
        lost = await self.loras.restore()  # adapters loaded while serving, on ranks that came back
        gone = [s.request_id for s in self.scheduler.sequences() if s.lora_name in lost]
        self._fail(gone, ERROR_CODE_NOT_FOUND, "its LoRA adapter no longer loads on the replica's ranks")
        log.info(
            "model %s on %d rank(s) (%s), max_model_len %d",
            first.model_name,
            len(info.describe),
            ", ".join(i.device for i in info.describe),
            cap.max_model_len,
        )
        self._set_ready(True)

    async def _workers_lost(self, error: WorkersLost) -> None:
        """A rank failed or went silent. Its peers' caches are useless too (the group must re-form), so
        every running sequence is requeued for recompute while the ranks are restarted."""
        if self._lost_at is None:  # the first loss starts the clock; failures before a good step do not
            self._lost_at = time.monotonic()
        if self.ready.is_set() or self.scheduler is not None:
            log.error("lost a shard worker (%s): waiting for the ranks to return", error)
        else:
            log.warning("shard workers not reachable (%s); retrying", error)
        self._set_ready(False)
        await self.workers.close()
        if self.scheduler is not None:
            self.scheduler.requeue_all()
        if self.fallback is not None:
            self.fallback.interrupt()  # recompute after a loss is not a throughput regression
        self._expiry_wakeup.set()

    async def _unfit_ranks(self, error: UnfitRanks) -> None:
        """The ranks came back but cannot serve as they are (imbalanced memory, a cache too small for one
        sequence): the requests in flight cannot wait on it, so each ends with UNAVAILABLE naming why (a
        router sends it to another replica, resumed), and the scheduler keeps trying the ranks."""
        log.error("the shard workers came back unfit to serve: %s; retrying in %.0fs", error, UNFIT_RETRY_S)
        self._set_ready(False)
        await self.workers.close()
        message = f"the replica's shard workers cannot serve: {error}"
        self._fail([s.request_id for s in self.scheduler.sequences()], ERROR_CODE_UNAVAILABLE, message)

    def _set_ready(self, ready: bool) -> None:
        if ready:
            self.ready.set()
        else:
            self.ready.clear()
        for listener in list(self._status_listeners):
            listener(ready)
        self.routers.shards_ready(ready, self.model_info)
        self._report(force_load=True)

    def watch_status(self, listener) -> None:
        """listener(ready) now and whenever the shards' state changes (the health service)."""
        self._status_listeners.add(listener)
        listener(self.ready.is_set())

    async def close(self) -> None:
        await self.workers.close()
