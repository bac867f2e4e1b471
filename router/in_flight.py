"""A request in flight at the router (router/pool.py holds them by id)."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

from common.block_hash import ImageSpan, adapter_extra, block_hashes, matchable_blocks
from common.pb.tpserve.internal.v1 import scheduler_pb2
from router.replicas import Routed
from router.slo import NO_OBJECTIVES, Objectives


@dataclass
class InFlight:
    """A request the router holds, from its arrival to its end: where it runs, what the client has been
    sent (to resume it elsewhere), what it was promised, and its prompt's block hashes."""

    add: scheduler_pb2.AddRequest
    arrival: float  # time.monotonic() at the router: kept through failover, so its queue age is true
    queue: asyncio.Queue  # the servicer's: RequestOutputs, then the end
    routed: Routed | None = None  # where it runs; None while it waits in the admission queue
    attempts: int = 0  # replicas it was sent to
    prompt: tuple[int, ...] = ()  # the client's prompt
    generated: list[int] = field(default_factory=list)  # every token the client has been sent
    objectives: Objectives = NO_OBJECTIVES  # what it was promised (router/slo.py)
    sent_at: float = 0.0  # time.monotonic() when it was last sent to a replica
    first_seen: bool = False  # a token came from the replica it was last sent to
    predicted_ttft: float | None = None  # what the SLO estimate said when it arrived
    # The chained hashes of the blocks a prefix cache may serve (common/block_hash.py), for the
    # cache-aware choice; computed when it is first routed, extended when it resumes with more tokens.
    hashes: list[bytes] = field(default_factory=list)

    def block_hashes(self, block_size: int) -> list[bytes]:
        """The hashes of the prompt's blocks a scheduler may take from its prefix cache, under its LoRA
        adapter (none when it wants prompt logprobs: the scheduler then computes every token)."""
        if self.add.want_prompt_logprobs:
            return []
        ids = self.add.prompt_token_ids
        n = matchable_blocks(len(ids), block_size)
        if len(self.hashes) < n:  # keyed by its adapter and images, as the scheduler's prefix cache keys them
            images = [ImageSpan(im.offset, im.length, im.hash) for im in self.add.images]
            extra = adapter_extra(self.add.lora_name)
            self.hashes = block_hashes(ids, block_size, n, extra, self.hashes, images)
        return self.hashes[:n]

    def resumed(self) -> scheduler_pb2.AddRequest:
        """The request as it goes to its next scheduler: the prompt plus what it already generated."""
        add = scheduler_pb2.AddRequest()
        add.CopyFrom(self.add)
        del add.prompt_token_ids[:]
        add.prompt_token_ids.extend(self.prompt)
        add.prompt_token_ids.extend(self.generated)
        add.num_output_tokens = len(self.generated)
        if self.generated:  # the client has its prompt logprobs already (they come before any token)
            add.want_prompt_logprobs = False
        return add
