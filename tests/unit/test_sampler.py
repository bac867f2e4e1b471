"""Sampler rules on small hand-made logits: what each knob keeps, drops or changes, and seeded streams
that do not depend on the batch."""

from __future__ import annotations

import math

import pytest
import torch

from common.sampling import SamplingConfig
from shard_worker.sampling import Sampler as _Sampler
from shard_worker.sampling import draw as sampler_module
from shard_worker.sampling.processors import Penalties
from shard_worker.step import SequenceInit

VOCAB = 50


class Sampler:
    """The sampler with the sequences' states kept by seq id, as the worker keeps them: one row each."""

    def __init__(self, vocab_size: int, eos_token_ids=()):
        self.sampler = _Sampler(vocab_size, "cpu", eos_token_ids)
        self.states = {}

    def add(self, init: SequenceInit) -> None:
        self.remove(init.seq_id)
        self.states[init.seq_id] = self.sampler.new_state(init)

    def remove(self, seq_id: int) -> None:
        state = self.states.pop(seq_id, None)
        if state is not None:
            self.sampler.release(state)

    def sample(self, seq_ids: list[int], logits: torch.Tensor):
        n = len(seq_ids)
        return self.sampler.sample([self.states[i] for i in seq_ids], [1] * n, [[]] * n, logits)

    def apply_penalties(self, seq_ids: list[int], logits: torch.Tensor) -> torch.Tensor:
        penalties = next(p for p in self.sampler.processors if isinstance(p, Penalties))
        out = logits.clone().float()
        penalties.apply([self.states[i] for i in seq_ids], torch.arange(len(seq_ids)), out)
        return out


def make_sampler(*configs: SamplingConfig, top_logprobs: int = 0) -> Sampler:
    sampler = Sampler(VOCAB)
    for i, cfg in enumerate(configs):
        sampler.add(SequenceInit(i, cfg, top_logprobs, [3, 4], 2))
    return sampler


def random_logits(rows: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(rows, VOCAB, generator=torch.Generator().manual_seed(seed)) * 2


def logits_for_probs(probs: list[float]) -> torch.Tensor:
    """One row over VOCAB whose first len(probs) tokens have these probabilities (the rest ~0)."""
    row = torch.full((VOCAB,), -1e9)
    row[: len(probs)] = torch.tensor(probs).log()
    return row


def draw_many(cfg: SamplingConfig, row: torch.Tensor, n: int = 2000) -> torch.Tensor:
    """n independent draws: n seeded sequences, so the test is deterministic."""
    sampler = Sampler(VOCAB)
    for i in range(n):
        sampler.add(SequenceInit(i, SamplingConfig(**{**cfg.__dict__, "seed": i}), 0, [], 0))
    return torch.tensor(sampler.sample(list(range(n)), row.expand(n, VOCAB)).token_ids)


def test_greedy_is_argmax():
    logits = random_logits(6)
    sampler = make_sampler(*[SamplingConfig(temperature=0.0)] * 6)
    assert sampler.sample(list(range(6)), logits).token_ids == logits.argmax(-1).tolist()


def test_top_k_1_is_greedy_whatever_the_temperature():
    logits = random_logits(6, seed=1)
    seeded = [SamplingConfig(temperature=5.0, top_k=1, seed=i) for i in range(3)]
    sampler = make_sampler(*seeded, *[SamplingConfig(temperature=5.0, top_k=1)] * 3)
    for _ in range(5):
        assert sampler.sample(list(range(6)), logits).token_ids == logits.argmax(-1).tolist()


def test_top_p_keeps_the_smallest_set_reaching_p():
    row = logits_for_probs([0.5, 0.3, 0.15, 0.05])
    # 0.5 < 0.7, 0.5 + 0.3 >= 0.7: tokens 0 and 1 stay, renormalised to 5/8 and 3/8.
    tokens = draw_many(SamplingConfig(top_p=0.7), row)
    assert set(tokens.tolist()) == {0, 1}
    assert (tokens == 0).float().mean().item() == pytest.approx(5 / 8, abs=0.05)


def test_top_k_keeps_the_k_most_likely():
    row = logits_for_probs([0.1, 0.4, 0.2, 0.3])
    assert set(draw_many(SamplingConfig(top_k=2), row).tolist()) == {1, 3}


def test_min_p_drops_tokens_below_the_fraction_of_the_best():
    row = logits_for_probs([0.5, 0.3, 0.15, 0.05])
    # Floor 0.4 * 0.5 = 0.2: 0.15 and 0.05 go.
    assert set(draw_many(SamplingConfig(min_p=0.4), row).tolist()) == {0, 1}


def test_temperature_reshapes_the_distribution():
    row = logits_for_probs([0.6, 0.4])
    # At temperature 0.5, probabilities go as p**2: 0.36 / (0.36 + 0.16).
    tokens = draw_many(SamplingConfig(temperature=0.5), row)
    assert (tokens == 0).float().mean().item() == pytest.approx(0.36 / 0.52, abs=0.04)
    tokens = draw_many(SamplingConfig(temperature=1.0), row)
    assert (tokens == 0).float().mean().item() == pytest.approx(0.6, abs=0.04)


def test_penalties_follow_the_hand_computed_rules():
    sampler = Sampler(5)
    cfg = SamplingConfig(repetition_penalty=2.0, presence_penalty=0.5, frequency_penalty=0.25)
    # Prompt [1]; output so far [3, 3, 2].
    sampler.add(SequenceInit(7, cfg, 0, [1, 3, 3, 2], 1))
    got = sampler.apply_penalties([7], torch.tensor([[2.0, -1.0, 0.5, 3.0, -2.0]]))
    expected = [
        2.0,  # never seen
        -1.0 * 2.0,  # prompt only: negative logit multiplied, no presence/frequency
        0.5 / 2.0 - 0.5 - 0.25 * 1,  # output once
        3.0 / 2.0 - 0.5 - 0.25 * 2,  # output twice
        -2.0,
    ]
    assert got[0].tolist() == pytest.approx(expected)


def test_sampled_tokens_count_towards_later_penalties():
    sampler = Sampler(2)
    sampler.add(SequenceInit(0, SamplingConfig(temperature=0.0, frequency_penalty=0.3), 0, [1], 1))
    logits = torch.tensor([[1.0, 0.5]])
    # 1.0 vs 0.5, then 0.7 vs 0.5, then 0.4 vs 0.5.
    assert [sampler.sample([0], logits).token_ids[0] for _ in range(3)] == [0, 0, 1]


def test_penalty_rows_are_reused_without_leaking():
    sampler = Sampler(3)
    cfg = SamplingConfig(temperature=0.0, presence_penalty=10.0)
    sampler.add(SequenceInit(0, cfg, 0, [0, 2, 2], 1))
    sampler.remove(0)
    sampler.add(SequenceInit(1, cfg, 0, [0], 1))
    assert sampler.apply_penalties([1], torch.zeros(1, 3))[0].tolist() == [0.0, 0.0, 0.0]


def test_seeded_sequence_ignores_the_rest_of_the_batch_and_survives_a_rebuild():
    cfg = SamplingConfig(temperature=1.0, top_p=0.95, seed=1234)
    steps = [random_logits(1, seed=100 + k)[0] for k in range(6)]

    alone = make_sampler(cfg)
    solo = [alone.sample([0], row[None]).token_ids[0] for row in steps]

    crowd = Sampler(VOCAB)
    crowd.add(SequenceInit(42, cfg, 0, [3, 4], 2))
    for i in range(5):
        crowd.add(SequenceInit(i, SamplingConfig(temperature=1.5, seed=None if i % 2 else 99 + i), 0, [], 0))
    batched = []
    for k, row in enumerate(steps):
        # The seeded sequence's position in the batch moves, and the others' logits change.
        others = random_logits(5, seed=k)
        order = list(range(5))
        order.insert(k % 6, 42)
        logits = torch.stack([row if sid == 42 else others[sid] for sid in order])
        out = crowd.sample(order, logits).token_ids
        batched.append(out[order.index(42)])
    assert batched == solo

    # A worker that lost the sequence after 3 tokens is told num_sampled=3 and continues the stream.
    rebuilt = Sampler(VOCAB)
    rebuilt.add(SequenceInit(0, cfg, 0, [3, 4, *solo[:3]], 2, num_sampled=3))
    assert [rebuilt.sample([0], row[None]).token_ids[0] for row in steps[3:]] == solo[3:]

    other_seed = make_sampler(SamplingConfig(temperature=1.0, top_p=0.95, seed=1235))
    assert [other_seed.sample([0], row[None]).token_ids[0] for row in steps] != solo


def test_logprobs_are_log_softmax_of_the_raw_logits():
    logits = random_logits(3, seed=5)
    sampler = Sampler(VOCAB)
    # Temperature and penalties change the choice but not the reported logprobs.
    sampler.add(
        SequenceInit(0, SamplingConfig(temperature=0.7, repetition_penalty=1.3, seed=1), 4, [1, 2], 2)
    )
    sampler.add(SequenceInit(1, SamplingConfig(temperature=0.0), 0, [1], 1))
    sampler.add(SequenceInit(2, SamplingConfig(temperature=0.0), 2, [1], 1))
    out = sampler.sample([0, 1, 2], logits)
    want = torch.log_softmax(logits, dim=-1)
    assert out.logprobs == pytest.approx([want[i, t].item() for i, t in enumerate(out.token_ids)], abs=1e-6)
    top0, top2 = want[0].topk(4), want[2].topk(2)
    assert out.top_token_ids == top0.indices.tolist() + top2.indices.tolist()
    assert out.top_logprobs == pytest.approx(top0.values.tolist() + top2.values.tolist(), abs=1e-6)
    assert all(math.isfinite(x) for x in out.logprobs)


def test_no_logprobs_unless_asked():
    sampler = make_sampler(SamplingConfig(temperature=0.0), SamplingConfig(temperature=1.0))
    out = sampler.sample([0, 1], random_logits(2))
    assert (out.logprobs, out.top_token_ids, out.top_logprobs) == ([], [], [])


# Peaked rows take the shortcut; flat rows, and a top_k beyond the candidates, need the full sort.
@pytest.mark.parametrize(("spread", "big_k"), [(8.0, 40), (1.0, 40), (8.0, 300)])
def test_candidate_shortcut_keeps_the_same_tokens_as_a_full_sort(monkeypatch, spread, big_k):
    vocab = 2000
    cases = [(0, 0.5), (0, 0.9), (5, 1.0), (5, 0.5), (big_k, 0.9), (0, 0.99), (40, 0.8), (0, 1.0)]
    logits = torch.randn(len(cases), vocab, generator=torch.Generator().manual_seed(3)) * spread
    top_k, top_p = [k for k, _ in cases], [p for _, p in cases]
    fast = sampler_module._top_k_top_p(logits, top_k, top_p)
    monkeypatch.setattr(sampler_module, "CANDIDATES", vocab)
    slow = sampler_module._top_k_top_p(logits, top_k, top_p)
    assert torch.equal(fast.isfinite(), slow.isfinite())
    assert fast[-1].isfinite().all()  # a row without filters keeps everything
    # Independent of the sampler's code: top_k 5 then top_p 0.5 by a plain sort.
    probs = torch.softmax(logits[3].topk(5).values, dim=-1)
    want = int((probs.cumsum(0) - probs < 0.5).sum())
    assert int(fast[3].isfinite().sum()) == want


@pytest.mark.parametrize("config", [SamplingConfig(seed=1), SamplingConfig(seed=1, top_p=0.5, top_k=3)])
def test_a_uniform_draw_that_rounds_to_one_still_picks_a_kept_token(monkeypatch, config):
    # The largest double below 1 becomes 1.0 in float32: the draw then lands at the very end of the CDF,
    # past every token, and must not fall on the last vocabulary id (probability zero here).
    monkeypatch.setattr(sampler_module, "_uniform", lambda bits: 1.0 - 2.0**-53)
    sampler = make_sampler(config)
    token = sampler.sample([0], logits_for_probs([0.2, 0.5, 0.3]).unsqueeze(0)).token_ids[0]
    assert token in (0, 1, 2)
