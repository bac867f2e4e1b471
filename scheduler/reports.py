"""What a step did and what the replica reports about itself: the step's outputs for the routers, the
running totals (GetStats, the benchmark), the load report (the routers' choice among replicas).

Everything that reports on steps reads one StepResult, and every count comes from one SchedulerSnapshot,
so a number means the same thing in each report.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from common.load import ReplicaLoad
from common.pb.tpserve.internal.v1 import scheduler_pb2, worker_pb2
from common.pb.tpserve.v1 import generation_pb2
from scheduler.plan import SchedulerOutput, SchedulerSnapshot, SequenceUpdate
from scheduler.speculation import SpeculationTotals


@dataclass(frozen=True)
class StepResult:
    """What one iteration did."""

    out: SchedulerOutput
    updates: list[SequenceUpdate]
    replies: list[worker_pb2.StepResponse]  # in rank order; rank 0's carries the samples
    seconds: float  # wall time of the whole step: plan, send, forward, receive, apply

    @property
    def forward_seconds(self) -> float:
        return max(r.forward_seconds for r in self.replies)

    @property
    def allreduce_seconds(self) -> float:
        return max(r.allreduce_seconds for r in self.replies)


@dataclass
class StepTotals:
    """Running sums the benchmark and GetStats read (mean batch size, time per step)."""

    steps: int = 0
    batched_seqs: int = 0
    batched_tokens: int = 0
    step_seconds: float = 0.0
    forward_seconds: float = 0.0
    allreduce_seconds: float = 0.0

    def add(self, result: StepResult, metrics) -> None:
        out, forward, allreduce = result.out, result.forward_seconds, result.allreduce_seconds
        self.steps += 1
        self.batched_seqs += len(out.scheduled)
        self.batched_tokens += out.num_batched_tokens
        self.step_seconds += result.seconds
        self.forward_seconds += forward
        self.allreduce_seconds += allreduce
        metrics.step_duration.observe(result.seconds)
        metrics.forward_duration.observe(forward)
        metrics.allreduce_duration.observe(allreduce)
        metrics.batch_size.observe(len(out.scheduled))
        metrics.batch_tokens.observe(out.num_batched_tokens)


def step_outputs(result: StepResult) -> list[scheduler_pb2.RequestOutput]:
    """A RequestOutput per sequence that got tokens, with their logprobs when it asked, and per sequence
    whose prompt logprobs this step computed (a chunk of a long prompt: those alone)."""
    logprobs = _logprobs(result.out, result.replies[0])
    prompt = _prompt_logprobs(result.out, result.replies[0])
    pooled = _pooled(result.replies[0])
    outputs = []
    for u in result.updates:
        seq = u.seq
        output = scheduler_pb2.RequestOutput(request_id=seq.request_id, token_ids=u.new_tokens)
        if seq.seq_id in logprobs:
            output.logprobs.extend(logprobs[seq.seq_id][: len(u.new_tokens)])
        if prompt:
            output.prompt_logprobs.extend(prompt.pop(seq.seq_id, ()))
        if u.finished:
            output.finish_reason = seq.finish_reason
            output.cached_tokens = seq.num_cached_tokens
            output.embedding.extend(pooled.get(seq.seq_id, ()))
        outputs.append(output)
    for item in result.out.scheduled if prompt else ():
        if item.seq.seq_id in prompt and not item.seq.is_finished:
            outputs.append(
                scheduler_pb2.RequestOutput(
                    request_id=item.seq.request_id, prompt_logprobs=prompt.pop(item.seq.seq_id)
                )
            )
    return outputs


def model_info(
    first: worker_pb2.DescribeResponse, max_model_len: int, world_size: int, block_size: int
) -> generation_pb2.ModelInfo:
    """What the routers validate against, from rank 0's description and the settled capacity; with what
    the ranks serve: generation, or pooling (vectors of what size, pairs or not)."""
    return generation_pb2.ModelInfo(
        model_name=first.model_name,
        vocab_size=first.vocab_size,
        max_model_len=max_model_len,
        eos_token_ids=first.eos_token_ids,
        tensor_parallel_size=world_size,
        block_size=block_size,
        runner=first.runner or "generate",
        embedding_size=first.embedding_size,
        cross_encoder=first.cross_encoder,
    )


def _pooled(reply: worker_pb2.StepResponse) -> dict[int, list[float]]:
    """Rank 0's pooled vectors by sequence (StepResponse.pooled: equal lengths, concatenated)."""
    ids = reply.pooled_seq_ids
    if not ids:
        return {}
    size = len(reply.pooled) // len(ids)
    return {seq_id: reply.pooled[i * size : (i + 1) * size] for i, seq_id in enumerate(ids)}


def _prompt_logprobs(
    out: SchedulerOutput, reply: worker_pb2.StepResponse
) -> dict[int, list[generation_pb2.Logprobs]]:
    """Per sequence, the prompt logprobs of this step's rows: positions [done - n, done) after the update,
    each for the prompt token after it."""
    if not len(reply.prompt_logprobs):
        return {}
    found: dict[int, list[generation_pb2.Logprobs]] = {}
    row = top_at = 0
    for item in out.scheduled:
        n, seq = item.num_prompt_logprobs, item.seq
        if not n:
            continue
        k = seq.prompt_logprobs or 0
        targets = seq.token_ids[seq.prompt_logprobs_done - n + 1 : seq.prompt_logprobs_done + 1]
        # (An aborted sequence's rows are still stepped over; its router drops what it gets.)
        targets = (targets + [0] * n)[:n]
        entries = found.setdefault(seq.seq_id, [])
        for target in targets:
            chosen = generation_pb2.TokenLogprob(
                token_id=target, logprob=reply.prompt_logprobs[row], rank=reply.prompt_ranks[row]
            )
            top = [
                generation_pb2.TokenLogprob(token_id=t, logprob=lp, rank=r + 1)
                for r, (t, lp) in enumerate(
                    zip(
                        reply.prompt_top_token_ids[top_at : top_at + k],
                        reply.prompt_top_logprobs[top_at : top_at + k],
                        strict=True,
                    )
                )
            ]
            entries.append(generation_pb2.Logprobs(chosen=chosen, top=top))
            row += 1
            top_at += k
    return found


def _logprobs(
    out: SchedulerOutput, reply: worker_pb2.StepResponse
) -> dict[int, list[generation_pb2.Logprobs]]:
    """Per sampled sequence that asked, the logprobs of each of its tokens. They arrive flat over every
    token of every sampled sequence, in batch order, each with its sequence's top_logprobs alternatives."""
    if not len(reply.logprobs):
        return {}
    found: dict[int, list[generation_pb2.Logprobs]] = {}
    token_at = top_at = 0
    for item, count in zip(out.sampled, reply.token_counts, strict=True):
        n = item.seq.top_logprobs
        for i in range(token_at, token_at + count):
            if n:
                top = [
                    generation_pb2.TokenLogprob(token_id=tid, logprob=lp)
                    for tid, lp in zip(
                        reply.top_token_ids[top_at : top_at + n],
                        reply.top_logprobs[top_at : top_at + n],
                        strict=True,
                    )
                ]
                chosen = generation_pb2.TokenLogprob(token_id=reply.token_ids[i], logprob=reply.logprobs[i])
                found.setdefault(item.seq.seq_id, []).append(generation_pb2.Logprobs(chosen=chosen, top=top))
            top_at += n
        token_at += count
    return found


def load_report(
    snap: SchedulerSnapshot | None, max_num_seqs: int, shards_ready: bool, recent_steps: Iterable[float]
) -> ReplicaLoad:
    """The replica's load, for the routers' choice among replicas (router/replicas.py)."""
    if snap is None:  # before the ranks first said what they hold
        return ReplicaLoad(0, 0, 0, 0, max_num_seqs, 0.0, shards_ready)
    recent = list(recent_steps)
    step_seconds = round(sum(recent) / len(recent), 3) if snap.in_flight and recent else 0.0
    return ReplicaLoad(
        waiting=snap.waiting,
        running=snap.running,
        swapped=snap.swapped,
        kv_blocks_free=snap.kv_blocks_free,
        kv_blocks_total=snap.kv_blocks_total,
        max_num_seqs=max_num_seqs,
        step_seconds=step_seconds,
        shards_ready=shards_ready,
    )


def stats(
    snap: SchedulerSnapshot | None, t: StepTotals, spec: SpeculationTotals | None
) -> generation_pb2.Stats:
    if snap is None:
        return generation_pb2.Stats()
    out = generation_pb2.Stats(
        kv_blocks_total=snap.kv_blocks_total,
        kv_blocks_free=snap.kv_blocks_free,
        num_running=snap.running,
        num_waiting=snap.waiting,
        num_swapped=snap.swapped,
        num_preemptions_total=snap.num_preemptions,
        num_steps_total=t.steps,
        batched_seqs_total=t.batched_seqs,
        batched_tokens_total=t.batched_tokens,
        step_seconds_total=t.step_seconds,
        forward_seconds_total=t.forward_seconds,
        allreduce_seconds_total=t.allreduce_seconds,
    )
    if spec is not None:
        out.spec_num_drafts_total = spec.num_drafts
        out.spec_num_draft_tokens_total = spec.num_draft_tokens
        out.spec_num_accepted_tokens_total = spec.num_accepted_tokens
        out.spec_num_emitted_tokens_total = spec.num_emitted_tokens
        out.spec_accepted_per_position_total.extend(spec.accepted_per_position)
    return out
