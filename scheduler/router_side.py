"""The engine as its routers see it (scheduler/server.py's servicer calls these): a router's stream
attached or gone, a request taken in or refused, aborted, the router's queue changed; every report a
router gets (outputs, credit from the admission window, the load, KV events) and the heartbeat that
sends the load when no step does; the replica's snapshot, load and stats. Engine (scheduler/engine.py)
inherits it.
"""

from __future__ import annotations

import asyncio

from common.load import ReplicaLoad
from common.pb.tpserve.internal.v1 import scheduler_pb2
from common.pb.tpserve.internal.v1.scheduler_pb2 import ERROR_CODE_INVALID_ARGUMENT
from common.pb.tpserve.v1 import generation_pb2
from scheduler.add_request import RequestError, sequence_for
from scheduler.plan import SchedulerSnapshot
from scheduler.reports import load_report, stats
from scheduler.router_streams import LOAD_REPORT_INTERVAL_S, RouterStream


class RouterSide:
    def attach(self, stream: RouterStream) -> None:
        """A router opened its stream: it learns the shards' state, its credit and the load at once."""
        self.routers.attach(stream)
        self.routers.shards_ready(self.ready.is_set(), self.model_info, stream)
        self._report(force_load=True)

    def detach(self, stream: RouterStream) -> None:
        """The router went away: drop everything it asked for."""
        for request_id in self.routers.detach(stream):
            self.abort(request_id)

    def add(self, msg: scheduler_pb2.AddRequest, stream: RouterStream) -> None:
        """Takes a request in; a refusal goes back on the stream as the request's error."""
        stream.adds_received += 1
        try:
            seq = sequence_for(msg, self.scheduler, self._next_seq_id, self.loras, self.model_info)
            self.scheduler.add(seq)
        except RequestError as e:
            self.refuse(stream, msg.request_id, e.code, str(e))
            return
        except ValueError as e:  # longer than this replica's max_model_len
            self.refuse(stream, msg.request_id, ERROR_CODE_INVALID_ARGUMENT, str(e))
            return
        self._next_seq_id += 1
        self.routers.bind(msg.request_id, stream)
        self.spans.start(seq, msg.trace_context)
        if seq.lora_name:  # held until every rank holds its adapter: no step reads a disk
            seq.adapter_ready = False
            self.loras.prefetch(seq.lora_name, self._adapter_fetched)
        self._wakeup.set()
        if self._lost_at is not None:
            self._expiry_wakeup.set()  # its own recovery clock starts now

    def refuse(self, stream: RouterStream, request_id: str, code: int, message: str) -> None:
        """The error, and the credit the refused add used given back, in one message."""
        error = scheduler_pb2.RequestOutput(request_id=request_id, error=message, error_code=code)
        window = None if self.scheduler is None else self._admission_window
        share = self.routers.shares(window).get(stream)
        stream.send(stream.message([error], share, self.load_report()))

    def abort(self, request_id: str) -> None:
        """Frees the request's blocks now; the workers forget it with the next step."""
        if self.scheduler is not None and self.scheduler.abort(request_id) is not None:
            self._end([(request_id, "aborted")])

    def queued_changed(self) -> None:
        """A router's queue changed size: min_batch_size may stop waiting, and the routers' shares of
        the admission window follow their queues at once."""
        self._wakeup.set()
        self._report()

    def _admission_window(self, best_priority: int | None = None) -> int:
        """The credit for a router whose best queued request has best_priority: the free slots, and the
        places it would take by preempting (scheduler/priority.py), split by RouterStreams.shares."""
        return self.scheduler.admission_window(self.admission_depth, best_priority)

    @property
    def admission_depth(self) -> int:
        """--admission-window, or for a pooling model at least --max-num-seqs: each input of a request is
        a sequence that leaves after its one step, and a window of 32 kept the steps of 64-input
        embedding requests half full (all-MiniLM-L6-v2, bfloat16: 210 sentences/s against 270-300 with
        128)."""
        pooling = self.model_info is not None and self.model_info.runner == "pooling"
        depth = self.config.admission_window
        return max(depth, self.scheduler.policy.max_num_seqs) if pooling else depth

    def _report(self, outputs=(), force_load: bool = False) -> None:
        """Sends each router its outputs, with the credit and the load when they changed, and what the
        prefix cache stored and evicted since the last report (a snapshot to a router that needs one)."""
        window = load = kv = cached = None
        if self.scheduler is not None:
            window = self._admission_window
            load = self.load_report()
            kv, cached = self.scheduler.blocks.take_events(), self.scheduler.blocks.snapshot_events
        elif force_load:
            load = self.load_report()
        self.routers.publish(outputs, window, load, force_load, kv, cached)

    async def heartbeat(self) -> None:
        """Reports the load every LOAD_REPORT_INTERVAL_S whatever happens, from its own task: the step
        loop awaits the ranks, so a long step does not hold it back and the router does not take the
        replica for dead."""
        while True:
            await asyncio.sleep(LOAD_REPORT_INTERVAL_S)
            self._report(force_load=True)
            if self.loras.draining:
                self.loras.tidy()  # an unloaded adapter whose requests all ended while idle

    # ---- what the replica reports ----

    def snapshot(self) -> SchedulerSnapshot | None:
        return None if self.scheduler is None else self.scheduler.snapshot()

    def load_report(self) -> ReplicaLoad:
        """This replica's load, for the routers' choice among replicas (router/replicas.py)."""
        return load_report(
            self.snapshot(), self.config.policy.max_num_seqs, self.ready.is_set(), self._recent_steps
        )

    def stats(self) -> generation_pb2.Stats:
        return stats(self.snapshot(), self.totals, self.speculator and self.speculator.totals)
