"""The scheduler's Engine driven by a fake worker group: no processes, no gRPC, no torch."""

from __future__ import annotations

import asyncio

import grpc
import numpy as np

from common.pb.tpserve.internal.v1 import scheduler_pb2, worker_pb2
from common.pb.tpserve.v1 import generation_pb2
from scheduler.capacity import Capacity
from scheduler.config import SchedulerConfig
from scheduler.engine import Engine
from scheduler.router_streams import RouterStream
from scheduler.workers import WorkerGroupInfo, WorkersLost

VOCAB = 100
EOS = 1


def next_token(tokens: list[int]) -> int:
    """The fake model: the next token depends only on the tokens so far (never EOS)."""
    return 2 + (sum(tokens) * 31 + len(tokens)) % (VOCAB - 2)


def expected(prompt: list[int], n: int) -> list[int]:
    out = []
    for _ in range(n):
        out.append(next_token(prompt + out))
    return out


class FakeWorkerGroup:
    """Stands in for scheduler/workers.py's WorkerGroup: one rank that answers steps with next_token."""

    def __init__(self, num_blocks: int = 64, num_host_blocks: int = 0):
        self.num_blocks = num_blocks
        self.num_host_blocks = num_host_blocks  # swap space (and the prefix cache's host tier)
        self.up = True  # connect() succeeds
        self.fail_steps: set[int] = set()  # steps (counted over the group's life) that lose the rank
        self.gate: asyncio.Semaphore | None = None  # when set up, each step waits for a release
        # step number -> a function that mangles that step's reply (a rank answering nonsense)
        self.mangle: dict = {}
        self.connect_errors: list[Exception] = []  # raised by the next connects, one each
        self.unreadable: dict[str, str] = {}  # LoRA adapters whose files do not read: name -> why
        self.prefetched: list[str] = []  # PrefetchLoRAAdapter calls, by adapter
        self.steps = 0
        self.connects = 0
        self.forgotten: list[int] = []
        self._tokens: dict[int, list[int]] = {}
        self._asks: dict[int, tuple[int, bool, int]] = {}  # seq id -> (top_logprobs, prompt ones, their k)
        self._broken: str | None = None
        self._on_lost = None

    async def connect(self, on_lost=lambda: None) -> WorkerGroupInfo:
        if not self.up:
            raise WorkersLost("connection refused")
        if self.connect_errors:
            raise self.connect_errors.pop(0)
        self.connects += 1
        self._tokens.clear()
        self._broken, self._on_lost = None, on_lost
        describe = worker_pb2.DescribeResponse(
            rank=0, world_size=1, model_name="fake", vocab_size=VOCAB, max_position_embeddings=512,
            eos_token_ids=[EOS], num_kv_blocks=self.num_blocks,
        )  # fmt: skip
        return WorkerGroupInfo((describe,), Capacity(self.num_blocks, 512, self.num_host_blocks))

    def lose_while_idle(self) -> None:
        """The rank's stream ends on its own (the process was killed) while nothing is stepping."""
        self._broken = "rank 0's step stream ended"
        self._on_lost()

    def check(self) -> None:
        if self._broken:
            raise WorkersLost(self._broken)

    async def step(self, data: bytes, step_id: int) -> list[worker_pb2.StepResponse]:
        self.steps += 1
        req = worker_pb2.StepRequest.FromString(data)
        for init in req.new_sequences:
            self._tokens[init.seq_id] = list(init.token_ids)
            self._asks[init.seq_id] = (init.top_logprobs, init.want_prompt_logprobs, init.prompt_logprobs)
        self.forgotten += list(req.forgotten_seq_ids)
        if self.gate is not None:
            await self.gate.acquire()
        if self.steps in self.fail_steps:
            raise WorkersLost("rank 0 died mid-step")
        seq_ids = np.frombuffer(req.seq_ids, "<i8")
        counts = np.frombuffer(req.sample_counts, "<i8")
        tokens = []
        for seq_id, n in zip(seq_ids.tolist(), counts.tolist(), strict=True):
            if n:
                t = next_token(self._tokens[seq_id])
                self._tokens[seq_id].append(t)
                tokens.append(t)
        reply = worker_pb2.StepResponse(step_id=step_id, token_ids=tokens, token_counts=[1] * len(tokens))
        self._logprobs(req, seq_ids, counts, reply)
        if self.steps in self.mangle:
            self.mangle[self.steps](reply)
        return [reply]

    def _logprobs(self, req, seq_ids, counts, reply) -> None:
        """What rank 0's sampler adds when sequences ask (shard_worker/sampling): a logprob per token once
        any sampled one asked, its alternatives per token; a row per prompt position asked for."""
        sampled = [int(i) for i, n in zip(seq_ids, counts, strict=True) if n]
        if any(self._asks[i][0] for i in sampled):
            for i, token in zip(sampled, reply.token_ids, strict=True):
                reply.logprobs.append(-0.5)
                reply.top_token_ids.extend([token] * self._asks[i][0])
                reply.top_logprobs.extend([-0.5] * self._asks[i][0])
        rows = np.frombuffer(req.prompt_logprob_counts, "<i8") if req.prompt_logprob_counts else ()
        for i, n in zip(seq_ids.tolist(), list(rows), strict=False):
            k = self._asks[i][2]
            for _ in range(int(n)):
                reply.prompt_logprobs.append(-1.0)
                reply.prompt_ranks.append(1)
                reply.prompt_top_token_ids.extend([2] * k)
                reply.prompt_top_logprobs.extend([-1.0] * k)

    async def on_every_rank(self, method: str, request) -> list:
        """The one rank's answer to a unary call: only PrefetchLoRAAdapter is faked (NOT_FOUND for an
        adapter in `unreadable`)."""
        assert method == "PrefetchLoRAAdapter", method
        self.prefetched.append(request.lora_name)
        why = self.unreadable.get(request.lora_name)
        return [worker_pb2.PrefetchLoRAAdapterResponse() if why is None else NotFound(why)]

    async def close(self) -> None:
        pass


class NotFound(grpc.RpcError):
    """A rank's NOT_FOUND, as grpc.aio raises it."""

    def __init__(self, details: str):
        self._details = details

    def code(self) -> grpc.StatusCode:
        return grpc.StatusCode.NOT_FOUND

    def details(self) -> str:
        return self._details


def add_request(request_id: str, prompt: list[int], max_new: int, **fields) -> scheduler_pb2.AddRequest:
    greedy = generation_pb2.SamplingParams(temperature=0.0)
    return scheduler_pb2.AddRequest(
        request_id=request_id, prompt_token_ids=prompt, max_new_tokens=max_new, sampling=greedy, **fields
    )


class Harness:
    """An engine, its fake group and one router stream, with what the router received."""

    def __init__(self, group: FakeWorkerGroup | None = None, **config):
        config.setdefault("worker_recovery_timeout_s", 30.0)
        self.group = group or FakeWorkerGroup()
        self.engine = Engine(SchedulerConfig(workers=("fake:0",), **config), self.group)
        self.stream = RouterStream()
        self.messages: list[scheduler_pb2.SchedulerMessage] = []
        self.ready_changes: list[bool] = []
        self.engine.watch_status(self.ready_changes.append)

    async def __aenter__(self):
        self.task = asyncio.create_task(self.engine.serve_forever())
        self.pump = asyncio.create_task(self._pump())
        await self.wait(lambda: self.engine.ready.is_set())
        self.engine.attach(self.stream)
        return self

    async def __aexit__(self, *exc):
        self.task.cancel()
        self.pump.cancel()
        await asyncio.gather(self.task, self.pump, return_exceptions=True)

    async def _pump(self):
        while True:
            self.messages.append(await self.stream.outbox.get())

    async def wait(self, condition, timeout: float = 20.0) -> None:
        async with asyncio.timeout(timeout):
            while not condition():
                await asyncio.sleep(0.005)

    def outputs(self, request_id: str) -> list[scheduler_pb2.RequestOutput]:
        return [o for m in self.messages for o in m.outputs if o.request_id == request_id]

    def tokens(self, request_id: str) -> list[int]:
        return [t for o in self.outputs(request_id) for t in o.token_ids]

    def finished(self, request_id: str) -> bool:
        return any(o.finish_reason or o.error for o in self.outputs(request_id))


def run(coro):
    return asyncio.run(coro)
