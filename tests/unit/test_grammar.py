"""The grammar processor on the tiny model's tokenizer (real llguidance, hand-made logits): the mask applies
before greedy's argmax and the draw, a complete grammar allows only EOS, a sequence rebuilt from its
output tokens (a lost rank, a resume) continues exactly as an undisturbed one, the rest of a batch is
untouched, and compiling is off the step: a sequence is ready only once its grammar has compiled."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import AutoTokenizer

from common.grammar import GrammarError, GrammarSpec, validate
from common.reasoning import ReasoningSpec
from common.sampling import SamplingConfig
from shard_worker.sampling import Sampler
from shard_worker.sampling.grammar import GrammarCompiler
from shard_worker.step import SequenceInit
from tests.conftest import TINY

VOCAB = json.loads((TINY / "config.json").read_text())["vocab_size"]
EOS = 1
PROMPT = [5, 6, 7]


@pytest.fixture(scope="module")
def tokenizer(tiny_model):
    return AutoTokenizer.from_pretrained(tiny_model)


@pytest.fixture(scope="module")
def compiler(tiny_model):
    return GrammarCompiler(tiny_model, VOCAB, [EOS])


def new(sampler, spec: GrammarSpec | None, seq_id=0, output=(), **cfg) -> object:
    config = SamplingConfig(**({"temperature": 0.0} | cfg), structured=spec)
    init = SequenceInit(seq_id, config, 0, PROMPT + list(output), len(PROMPT), num_sampled=len(output))
    state = sampler.new_state(init)
    assert sampler.grammar_ready(state, timeout=30)
    return state


def run(sampler, states, steps: int, seed: int = 0) -> list[list[int]]:
    """Greedy or seeded steps over random logits (the same for every run with this seed); a sequence that
    produced EOS stops."""
    generator = torch.Generator().manual_seed(seed)
    out = [[] for _ in states]
    for _ in range(steps):
        logits = torch.randn(len(states), VOCAB, generator=generator) * 3
        live = [i for i, o in enumerate(out) if not o or o[-1] != EOS]
        if not live:
            break
        rows = logits[live]
        result = sampler.sample([states[i] for i in live], [1] * len(live), [[]] * len(live), rows)
        for i, t in zip(live, result.token_ids, strict=True):
            out[i].append(t)
    return out


def test_the_mask_applies_before_the_argmax_and_a_complete_grammar_ends_with_eos(compiler, tokenizer):
    sampler = Sampler(VOCAB, "cpu", [EOS], compiler)
    state = new(sampler, GrammarSpec("choice", json.dumps(["yes", "no"])))
    # Every row's argmax is a token the grammar forbids; the grammar's own tokens are the least likely.
    [tokens] = run(sampler, [state], 10)
    assert tokens[-1] == EOS
    assert tokenizer.decode(tokens[:-1]) in ("yes", "no")
    logits = torch.zeros(1, VOCAB)
    logits[0, 42] = 50.0
    fresh = new(sampler, GrammarSpec("regex", "ab"))
    got = []
    for _ in range(4):
        [t] = sampler.sample([fresh], [1], [[]], logits.clone()).token_ids
        got.append(t)
        if t == EOS:
            break
    assert tokenizer.decode(got[:-1]) == "ab" and got[-1] == EOS  # forced on to EOS, never past it


def test_json_schema_sampled_output_parses_and_validates(compiler, tokenizer):
    import jsonschema

    schema = {
        "type": "object",
        "properties": {"n": {"type": "integer", "minimum": 1, "maximum": 9}, "c": {"enum": ["red", "blue"]}},
        "required": ["n", "c"],
        "additionalProperties": False,
    }
    sampler = Sampler(VOCAB, "cpu", [EOS], compiler)
    spec = GrammarSpec("json_schema", json.dumps(schema))
    states = [new(sampler, spec, i, temperature=1.0, seed=i) for i in range(4)]
    for tokens in run(sampler, states, 200):
        assert tokens[-1] == EOS
        jsonschema.validate(json.loads(tokenizer.decode(tokens[:-1])), schema)


def test_a_rebuilt_sequence_continues_as_an_undisturbed_one(compiler):
    """Replayed output tokens put the matcher where it was: greedy and seeded alike."""
    spec = GrammarSpec("json_object", "")
    for cfg in ({"temperature": 0.0}, {"temperature": 1.0, "seed": 11}):
        sampler = Sampler(VOCAB, "cpu", [EOS], compiler)
        [whole] = run(sampler, [new(sampler, spec, **cfg)], 40, seed=1)
        # The same logits stream, with the sequence rebuilt from its first 15 tokens halfway.
        generator = torch.Generator().manual_seed(1)
        first, rest = [], []
        state = new(sampler, spec, **cfg)
        for step in range(40):
            logits = torch.randn(1, VOCAB, generator=generator) * 3
            if step == 15:
                sampler.release(state)
                state = new(sampler, spec, 1, output=first, **cfg)
            if (first + rest) and (first + rest)[-1] == EOS:
                break
            [t] = sampler.sample([state], [1], [[]], logits).token_ids
            (first if step < 15 else rest).append(t)
        assert first + rest == whole


def test_the_rest_of_a_batch_is_untouched(compiler):
    sampler = Sampler(VOCAB, "cpu", [EOS], compiler)
    mixed = [
        new(sampler, None, 0),
        new(sampler, GrammarSpec("regex", "[a-c]+")),
        new(sampler, None, 1, temperature=1.0, seed=5),
    ]
    together = run(sampler, mixed, 12, seed=3)
    # The plain sequences again, without the grammar one, each on the logits of the row it had.
    generator = torch.Generator().manual_seed(3)
    sampler = Sampler(VOCAB, "cpu", [EOS], compiler)
    again = [new(sampler, None, 0), new(sampler, None, 1, temperature=1.0, seed=5)]
    want = [[], []]
    for _ in range(12):
        logits = torch.randn(3, VOCAB, generator=generator) * 3
        live = [i for i in range(2) if not want[i] or want[i][-1] != EOS]
        if not live:
            break
        rows = logits[[0, 2]][live]
        got = sampler.sample([again[i] for i in live], [1] * len(live), [[]] * len(live), rows).token_ids
        for i, t in zip(live, got, strict=True):
            want[i].append(t)
    assert [together[0], together[2]] == want


def test_grammars_compile_off_the_step_and_bad_ones_are_named(compiler):
    sampler = Sampler(VOCAB, "cpu", [EOS], compiler)
    spec = GrammarSpec("regex", "x{1,3}y")  # never compiled before: a future, not a matcher
    config = SamplingConfig(temperature=0.0, structured=spec)
    state = sampler.new_state(SequenceInit(9, config, 0, PROMPT, len(PROMPT)))
    assert sampler.grammar_ready(state, timeout=30)
    # The second sequence with the same spec finds it compiled: ready at once.
    other = sampler.new_state(SequenceInit(10, config, 0, PROMPT, len(PROMPT)))
    assert sampler.grammar_ready(other, timeout=0)
    with pytest.raises(GrammarError, match="unclosed group"):
        validate(GrammarSpec("regex", "a(b"))
    bad = sampler.new_state(
        SequenceInit(11, SamplingConfig(structured=GrammarSpec("grammar", "start: nothing")), 0, PROMPT, 3)
    )
    with pytest.raises(GrammarError, match="unknown name"):
        sampler.grammar_ready(bad, timeout=30)


def test_min_tokens_cannot_hold_a_complete_grammar_open(compiler, tokenizer):
    """The grammar wins over processors before it: when they ban everything it allows, its tokens stay."""
    sampler = Sampler(VOCAB, "cpu", [EOS], compiler)
    state = new(sampler, GrammarSpec("regex", "a"), min_tokens=5)
    [tokens] = run(sampler, [state], 6)
    assert tokenizer.decode(tokens[:-1]) == "a" and tokens[-1] == EOS


@pytest.mark.parametrize(
    "spec, allowed",
    [
        (GrammarSpec("grammar", 'start: "yes" | "no"'), {"yes", "no"}),  # Lark
        (GrammarSpec("grammar", 'root ::= "yes" | "no"'), {"yes", "no"}),  # llama.cpp's GBNF
        (GrammarSpec("choice", json.dumps(['say "hi"', "a|b"])), {'say "hi"', "a|b"}),  # escaped exactly
    ],
)
def test_lark_gbnf_and_choices_with_quotes(compiler, tokenizer, spec, allowed):
    validate(spec)
    sampler = Sampler(VOCAB, "cpu", [EOS], compiler)
    states = [new(sampler, spec, i, temperature=1.0, seed=i) for i in range(4)]
    for tokens in run(sampler, states, 20):
        assert tokens[-1] == EOS and tokenizer.decode(tokens[:-1]) in allowed


def test_a_grammar_starts_after_the_think_block_that_the_budget_closes(compiler, tokenizer):
    """A reasoning model's sequence (common/reasoning.py): free tokens inside the think block, its end tag
    forced once the thinking budget is spent (however unlikely), then the grammar over the content only;
    rebuilt at any point (inside the block, or after it) it continues exactly as an undisturbed one."""
    end = 100
    think = ReasoningSpec(start_ids=(99,), end_ids=(end,), starts_inside=True, budget=6)
    spec = GrammarSpec("choice", json.dumps(["yes", "no"]))

    def logits_stream():
        generator = torch.Generator().manual_seed(3)
        while True:
            logits = torch.randn(1, VOCAB, generator=generator) * 3
            logits[0, end] = -1e4  # the model would never close the block on its own
            yield logits

    sampler = Sampler(VOCAB, "cpu", [EOS], compiler)
    state = new(sampler, spec, reasoning=think)
    whole = []
    for logits in logits_stream():
        [t] = sampler.sample([state], [1], [[]], logits).token_ids
        whole.append(t)
        if t == EOS or len(whole) > 30:
            break
    assert whole[6] == end and end not in whole[:6]
    assert whole[-1] == EOS and tokenizer.decode(whole[7:-1]) in ("yes", "no")
    for cut in (3, 7, 8):
        got, stream = [], logits_stream()
        state = new(sampler, spec, reasoning=think)
        for step, logits in enumerate(stream):
            if step == cut:
                sampler.release(state)
                state = new(sampler, spec, 1, output=got, reasoning=think)
            [t] = sampler.sample([state], [1], [[]], logits).token_ids
            got.append(t)
            if t == EOS or len(got) > 30:
                break
        assert got == whole, cut
