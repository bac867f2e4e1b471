"""The rows of a step's hidden states that rank 0 reads logits from: each sampled sequence's last positions
(and the proposals among them to verify), and the prompt positions whose logprobs a request asked for.
"""

from __future__ import annotations

import numpy as np
import torch

from shard_worker.step import StepInputs, StepOutputs

# Prompt logprob rows per pass: [rows, vocab] float32 logits at a time, so a long prompt never needs
# prompt_len x vocab of them at once.
PROMPT_LOGPROB_CHUNK = 256


def prompt_logprobs(model, hidden: torch.Tensor, inputs: StepInputs, out: StepOutputs) -> None:
    """Rank 0: each prompt row's log-softmax (the raw distribution, as the output's logprobs): the
    logprob and rank of the prompt token that follows, and its alternatives. Every rank computes the
    logits (the LM head gathers); only rank 0 gets them."""
    rows = torch.from_numpy(inputs.prompt_rows).to(hidden.device)
    for at in range(0, len(rows), PROMPT_LOGPROB_CHUNK):
        chunk = slice(at, at + PROMPT_LOGPROB_CHUNK)
        logits = model.compute_logits(hidden.index_select(0, rows[chunk]))
        if logits is None:
            continue
        lp = torch.log_softmax(logits.float(), dim=-1)
        targets = torch.from_numpy(inputs.prompt_targets[chunk]).to(lp.device)
        chosen = lp.gather(1, targets.unsqueeze(1))
        out.prompt_logprobs += chosen.squeeze(1).tolist()
        out.prompt_ranks += ((lp > chosen).sum(dim=-1) + 1).tolist()
        tops = inputs.prompt_tops[chunk]
        if tops.max() > 0:
            values, ids = lp.topk(int(tops.max()), dim=-1)
            for k, v_row, i_row in zip(tops.tolist(), values.tolist(), ids.tolist(), strict=True):
                out.prompt_top_token_ids += i_row[:k]
                out.prompt_top_logprobs += v_row[:k]


def sampled_rows(ends: np.ndarray, counts: np.ndarray) -> np.ndarray:
    """The step rows sampled: each sampled sequence's last counts[i] rows, ending (exclusive) at ends[i]."""
    if bool((counts == 1).all()):
        return ends - 1
    firsts = np.repeat(ends - counts, counts)
    offsets = np.arange(int(counts.sum())) - np.repeat(np.cumsum(counts) - counts, counts)
    return firsts + offsets


def step_proposals(input_ids: np.ndarray, rows: np.ndarray, counts: np.ndarray) -> list[list[int]]:
    """Each sampled sequence's proposals: the inputs after its first sampled row (none for most)."""
    if bool((counts == 1).all()):
        return [[]] * len(counts)
    firsts = rows[np.cumsum(counts) - counts]
    return [input_ids[r + 1 : r + c].tolist() for r, c in zip(firsts, counts, strict=True)]
