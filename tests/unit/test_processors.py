"""Logits processors and several sampled rows per sequence, on hand-made logits: logit_bias, min_tokens,
bad words; each applies only to the sequences that ask, greedy included; a sequence sampled at several
positions keeps going while its tokens equal the proposals, and its seeded draws are those of one token
per step."""

from __future__ import annotations

import pytest
import torch

from common.sampling import SamplingConfig
from shard_worker.sampling import Sampler
from shard_worker.step import SequenceInit

VOCAB = 20
EOS = 1
GREEDY = SamplingConfig(temperature=0.0)


def states(sampler: Sampler, *configs: SamplingConfig, tokens=(3, 4), stop_token_ids=()):
    return [
        sampler.new_state(SequenceInit(i, c, 0, list(tokens), 2, stop_token_ids=stop_token_ids))
        for i, c in enumerate(configs)
    ]


def one_each(sampler: Sampler, seqs, logits) -> list[int]:
    n = len(seqs)
    return sampler.sample(seqs, [1] * n, [[]] * n, logits).token_ids


def peaked(rows: int, best: int = 5) -> torch.Tensor:
    """Rows whose argmax is `best` by a wide margin; the other logits small and distinct."""
    logits = torch.arange(VOCAB, dtype=torch.float32).repeat(rows, 1) * 0.01
    logits[:, best] = 10.0
    return logits


def test_logit_bias_forces_and_bans_only_where_asked():
    sampler = Sampler(VOCAB, "cpu", [EOS])
    force = SamplingConfig(temperature=0.0, logit_bias=((7, 100.0),))
    ban = SamplingConfig(temperature=0.0, logit_bias=((5, -100.0),))
    seqs = states(sampler, force, ban, GREEDY)
    assert one_each(sampler, seqs, peaked(3)) == [7, 19, 5]  # the unbiased row is untouched
    sampled = states(sampler, SamplingConfig(temperature=1.0, seed=3, logit_bias=((7, 100.0),)))
    assert one_each(sampler, sampled, peaked(1)) == [7]


def test_min_tokens_holds_back_eos_and_stop_ids_until_reached():
    sampler = Sampler(VOCAB, "cpu", [EOS])
    cfg = SamplingConfig(temperature=0.0, min_tokens=2)
    [seq] = states(sampler, cfg, stop_token_ids=(9,))
    eos_first = peaked(1, best=EOS)
    eos_first[0, 9] = 9.0  # then the stop id, then the rest
    got = [one_each(sampler, [seq], eos_first)[0] for _ in range(3)]
    assert got == [19, 19, EOS]  # two tokens generated, then EOS may come
    # A sequence rebuilt with one output token already has one to go.
    rebuilt = sampler.new_state(SequenceInit(5, cfg, 0, [3, 4, 19], 2, num_sampled=1, stop_token_ids=(9,)))
    assert one_each(sampler, [rebuilt], eos_first) == [19]
    assert one_each(sampler, [rebuilt], eos_first) == [EOS]


def test_bad_words_ban_the_last_token_after_the_rest():
    sampler = Sampler(VOCAB, "cpu", [EOS])
    cfg = SamplingConfig(temperature=0.0, bad_words_token_ids=((5,), (8, 6)))
    [seq] = states(sampler, cfg)
    logits = peaked(1, best=5)
    logits[0, 8] = 9.0
    logits[0, 6] = 8.0
    # 5 is always banned; 8 is fine; after 8, 6 is banned.
    assert one_each(sampler, [seq], logits) == [8]
    assert one_each(sampler, [seq], logits) == [8]  # 6 is banned after 8, so 8 again
    other = peaked(1, best=6)
    assert one_each(sampler, [seq], other) == [19]  # after 8: 6 banned
    [fresh] = states(sampler, cfg)
    assert one_each(sampler, [fresh], other) == [6]  # not after 8


def test_processors_leave_the_rest_of_a_batch_untouched():
    """Each row of a mixed batch gets what it gets alone."""
    configs = [
        SamplingConfig(temperature=0.0, logit_bias=((2, 50.0),)),
        SamplingConfig(temperature=0.9, seed=11),
        SamplingConfig(temperature=0.0, min_tokens=3),
        SamplingConfig(temperature=0.7, seed=5, bad_words_token_ids=((13,),), frequency_penalty=1.0),
        GREEDY,
    ]
    logits = torch.randn(5, VOCAB, generator=torch.Generator().manual_seed(0)) * 3
    together = Sampler(VOCAB, "cpu", [EOS])
    batch = [one_each(together, states(together, *configs), logits)]
    alone = []
    for i, c in enumerate(configs):
        s = Sampler(VOCAB, "cpu", [EOS])
        alone += one_each(s, states(s, c), logits[i : i + 1])
    assert batch[0] == alone


def test_several_rows_accept_proposals_while_they_match():
    """Rows 0..2 of one sequence: proposals [5, 6]. Greedy tokens 5, 6, 9 are all accepted; with the
    second proposal wrong, the sequence gets 5 then the model's own token."""
    sampler = Sampler(VOCAB, "cpu", [EOS])
    rows = torch.stack([peaked(1, 5)[0], peaked(1, 6)[0], peaked(1, 9)[0]])
    [seq] = states(sampler, GREEDY)
    out = sampler.sample([seq], [3], [[5, 6]], rows)
    assert out.token_counts == [3] and out.token_ids == [5, 6, 9]
    [seq] = states(sampler, GREEDY)
    out = sampler.sample([seq], [3], [[5, 7]], rows)
    assert out.token_counts == [2] and out.token_ids == [5, 6]
    assert seq.num_sampled == 2 and seq.output_ids == [5, 6]


def test_several_rows_see_the_state_after_the_accepted_tokens():
    """min_tokens counts the accepted tokens: EOS becomes allowed at the right depth."""
    sampler = Sampler(VOCAB, "cpu", [EOS])
    [seq] = states(sampler, SamplingConfig(temperature=0.0, min_tokens=2))
    eos = peaked(1, EOS)[0]
    eos[19] = 5.0
    out = sampler.sample([seq], [3], [[19, 19]], torch.stack([eos, eos, eos]))
    assert out.token_ids == [19, 19, EOS]


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_seeded_draws_do_not_depend_on_verifying_several_rows(seed):
    """The draw for output position i depends only on (seed, i): sampling rows one step at a time and
    verifying them in one step (proposals equal to what the draws give) yield the same tokens."""
    cfg = SamplingConfig(temperature=1.0, seed=seed)
    rows = torch.randn(4, VOCAB, generator=torch.Generator().manual_seed(seed)) * 2
    step_by_step = Sampler(VOCAB)
    [seq] = states(step_by_step, cfg)
    singles = [one_each(step_by_step, [seq], rows[i : i + 1])[0] for i in range(4)]
    verified = Sampler(VOCAB)
    [seq] = states(verified, cfg)
    out = verified.sample([seq], [4], [singles[:3]], rows)
    assert out.token_ids == singles and out.token_counts == [4]


def test_logprobs_for_every_token_of_several_rows():
    sampler = Sampler(VOCAB)
    seq = sampler.new_state(SequenceInit(0, GREEDY, 2, [3], 1))
    other = sampler.new_state(SequenceInit(1, GREEDY, 0, [3], 1))
    rows = torch.randn(3, VOCAB, generator=torch.Generator().manual_seed(4))
    first = int(rows[0].argmax())
    out = sampler.sample([seq, other], [2, 1], [[first], []], rows)
    want = torch.log_softmax(rows, -1)
    assert out.token_counts == [2, 1] and len(out.logprobs) == 3
    assert out.logprobs == pytest.approx(
        [want[r, t].item() for r, t in zip([0, 1, 2], out.token_ids, strict=True)]
    )
    assert out.top_token_ids == want[0].topk(2).indices.tolist() + want[1].topk(2).indices.tolist()
