"""A sequence: one request's tokens, where its computation stands, and the KV blocks it holds."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any

from common.block_hash import ImageSpan
from common.pb.tpserve.v1 import generation_pb2


class SequenceStatus(enum.Enum):
    WAITING = "waiting"  # not admitted yet, or preempted and waiting to be recomputed
    RUNNING = "running"  # in the batch; holds KV blocks
    SWAPPED = "swapped"  # preempted with its KV copied to host blocks; comes back where it was
    FINISHED = "finished"


# Why a sequence ended: the public API's enum itself (tpserve.v1.FinishReason; FINISH_REASON_* values),
# so the value travels to the router and the client unchanged.
FinishReason = generation_pb2.FinishReason


@dataclass
class Sequence:
    seq_id: int
    request_id: str
    token_ids: list[int]  # prompt, then every token generated so far (then num_pending placeholders)
    num_prompt_tokens: int
    max_new_tokens: int
    stop_token_ids: frozenset[int] = frozenset()
    ignore_eos: bool = False
    top_logprobs: int = 0
    # Opaque to the scheduler: passed to the worker that samples (a tpserve.v1.SamplingParams).
    sampling: Any = None
    arrival_time: float = 0.0
    status: SequenceStatus = SequenceStatus.WAITING
    # Tokens whose KV is in the cache. The sequence is "caught up" when this equals len(token_ids) - 1
    # after a decode, or len(token_ids) at the moment a step samples.
    num_computed_tokens: int = 0
    block_table: list[int] = field(default_factory=list)
    # Its recurrent-state slot (scheduler/state_slots.py) while it holds blocks, for models with
    # linear-attention layers; None otherwise.
    state_slot: int | None = None
    # The other layer groups' block tables (common/kv_cache_spec.py), as long as block_table; kept by the
    # block manager, empty for a model with one group.
    group_tables: list[list[int]] = field(default_factory=list)
    finish_reason: int | None = None  # a FinishReason value once finished
    num_preemptions: int = 0
    # Prompt tokens whose KV came from the prefix cache at first admission (Usage.cached_tokens).
    num_cached_tokens: int = 0
    # Admitted at least once: a re-admission (after a recompute preemption or lost ranks) is the same
    # client request, and is not counted again in the prefix-cache metrics.
    admitted_before: bool = False
    # Its block table lost blocks at the end (rejected proposals' slots) since the workers last heard of
    # it: the next step sends the table whole, since the blocks that replace them may differ.
    table_shrunk: bool = False
    # Structured outputs: False while rank 0 compiles its grammar (it waits in the queue, holding nothing,
    # and is admitted once the worker reports the grammar ready). True for a sequence without a grammar.
    grammar_ready: bool = True
    # LoRA: False while the ranks prefetch its adapter into their host caches (scheduler/lora_admin.py):
    # it waits in the queue, holding nothing, so that no step reads an adapter from disk.
    adapter_ready: bool = True
    has_grammar: bool = False
    # Several choices of one request (n): the choice whose prompt blocks this one shares once computed.
    fork_of: Sequence | None = None
    forks_waiting: int = 0  # choices waiting to share this one's prompt blocks
    # Prompt logprobs wanted (vLLM's prompt_logprobs, with this many alternatives); None: not wanted.
    prompt_logprobs: int | None = None
    # Prompt positions whose logprobs were computed and sent (a recompute does not send them again).
    prompt_logprobs_done: int = 0
    # The proposer's own state for this sequence (speculative decoding: its n-gram index, its recent
    # acceptance), kept here so that it goes with the sequence.
    proposer_state: Any = None
    lora_name: str = ""  # the LoRA adapter it runs on; "": the base model
    images: tuple[ImageSpan, ...] = ()  # the prompt's images: part of its blocks' hashes
    # The same images as the router sent them (scheduler.proto PromptImage, pixels included): opaque
    # here, handed to the workers each time the sequence is introduced (their vision encoder's input).
    image_inputs: tuple[Any, ...] = ()
    # vLLM's priority (lower first) and when its first token is due (monotonic; None: no TTFT objective):
    # the waiting queue's order (scheduler/slack.py).
    priority: int = 0
    ttft_deadline: float | None = None
    # Async scheduling (scheduler/overlap.py): tokens a step in flight samples for it, not known yet,
    # held as placeholders at the end of token_ids so that the next step can be planned.
    num_pending: int = 0
    # A pooling request (embeddings, scores): its prompt is computed whole in one step that samples
    # nothing, it never reads nor fills the prefix cache, and it ends with that step (Scheduler.update).
    pooling: bool = False
    token_type_start: int = 0  # a cross-encoder pair's second text (the workers' token types)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        """Tokens generated and known (placeholders not counted)."""
        return len(self.token_ids) - self.num_prompt_tokens - self.num_pending

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED


def from_request(msg, seq_id: int, arrival_time: float, fork_of: Sequence | None) -> Sequence:
    """A router's AddRequest (scheduler.proto) as a new sequence. fork_of: an earlier choice of the same
    request with the same prompt, whose prompt blocks this one shares."""
    has_grammar = msg.sampling.HasField("structured_output")
    return Sequence(
        seq_id=seq_id,
        request_id=msg.request_id,
        token_ids=list(msg.prompt_token_ids),
        # A resumed request's own outputs are outputs here too (max_new_tokens, seeded draws).
        num_prompt_tokens=len(msg.prompt_token_ids) - msg.num_output_tokens,
        max_new_tokens=msg.max_new_tokens,
        stop_token_ids=frozenset(msg.stop_token_ids),
        ignore_eos=msg.ignore_eos,
        top_logprobs=msg.top_logprobs,
        sampling=msg.sampling,
        arrival_time=arrival_time,
        has_grammar=has_grammar,
        grammar_ready=not has_grammar,
        fork_of=fork_of,
        prompt_logprobs=msg.prompt_logprobs if msg.want_prompt_logprobs else None,
        lora_name=msg.lora_name,
        images=tuple(ImageSpan(im.offset, im.length, im.hash) for im in msg.images),
        image_inputs=tuple(msg.images),
        priority=msg.priority,
        ttft_deadline=arrival_time + msg.ttft_budget_ms / 1000 if msg.ttft_budget_ms else None,
        pooling=msg.pooling,
        token_type_start=msg.token_type_start,
    )
