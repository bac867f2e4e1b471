"""ModelRunner against transformers on the tiny model, in float64: the same greedy tokens, token for
token, with prompts of different lengths batched together, a prompt chunked over two steps, sequences
joining mid-way, and KV blocks handed out in a scrambled order."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest
import torch
from transformers import LlamaForCausalLM

from common.sampling import SamplingConfig
from shard_worker.attention import StepBatch
from shard_worker.model_runner import ModelRunner
from shard_worker.parallel import TensorParallel
from shard_worker.step import SequenceInit, StepInputs

torch.set_flush_denormal(True)

BLOCK_SIZE = 4  # small, so that even short prompts span several blocks
NUM_BLOCKS = 96
GREEDY = SamplingConfig(temperature=0.0)


@dataclass
class Seq:
    seq_id: int
    tokens: list[int]  # prompt, then sampled tokens
    prompt_len: int
    num_computed: int = 0
    blocks: list[int] = field(default_factory=list)

    @property
    def output(self) -> list[int]:
        return self.tokens[self.prompt_len :]


class BlockPool:
    """Hands out blocks in a scrambled order, so a sequence's blocks are never contiguous."""

    def __init__(self, num_blocks: int):
        self.free = [(i * 37) % num_blocks for i in range(num_blocks)]

    def grow(self, seq: Seq, num_tokens: int) -> None:
        while len(seq.blocks) * BLOCK_SIZE < num_tokens:
            seq.blocks.append(self.free.pop())


def plan(pool: BlockPool, chunks: list[tuple[Seq, int]]) -> StepInputs:
    """The StepInputs computing the next n tokens of each (seq, n)."""
    names = ("seq_ids", "query_lens", "context_lens", "sample_counts", "input_ids")
    inp = {name: [] for name in names}
    tables = []
    for seq, n in chunks:
        start, end = seq.num_computed, seq.num_computed + n
        pool.grow(seq, end)
        inp["seq_ids"].append(seq.seq_id)
        inp["query_lens"].append(n)
        inp["context_lens"].append(end)
        inp["sample_counts"].append(int(end == len(seq.tokens)))
        inp["input_ids"] += seq.tokens[start:end]
        tables.append(list(seq.blocks))
    return StepInputs(**inp, block_table=StepInputs.pad_tables(tables))


class Driver:
    """Runs steps on a ModelRunner as the worker does, keeping each sequence's sampling state."""

    def __init__(self, runner: ModelRunner):
        self.runner = runner
        self.states = {}

    def add(self, inits: list[SequenceInit]) -> None:
        for init in inits:
            self.states[init.seq_id] = self.runner.sampler.new_state(init)

    def execute(self, inp: StepInputs):
        if getattr(self.runner.model, "has_state", False):  # linear attention: a slot per sequence id
            if not self.runner.state_caches:
                self.runner.allocate_state_cache(64)
            inp.state_slots = inp.seq_ids.copy()
        sampled = [self.states[int(i)] for i, n in zip(inp.seq_ids, inp.sample_counts, strict=True) if n]
        return self.runner.execute(inp, sampled)


def forward_logits(runner: ModelRunner, inp: StepInputs) -> torch.Tensor:
    """Every position's logits for a step, straight from the model (no sampling)."""
    batch = StepBatch.build(
        inp.input_ids, inp.query_lens, inp.context_lens, inp.block_table, BLOCK_SIZE, runner.device
    )
    with torch.inference_mode():
        hidden = runner.model(
            batch.input_ids, batch.positions, runner.attention.context(batch), runner.kv_caches
        )
        return runner.model.compute_logits(hidden)


def run_step(driver: Driver, pool: BlockPool, chunks: list[tuple[Seq, int]]):
    inp = plan(pool, chunks)
    out = driver.execute(inp)
    sampled = [seq for (seq, _), s in zip(chunks, inp.sample_counts, strict=True) if s]
    assert out.token_counts == [1] * len(sampled)
    for seq, n in chunks:
        seq.num_computed += n
    for seq, token in zip(sampled, out.token_ids, strict=True):
        seq.tokens.append(token)
    return out


def prompt(length: int, salt: int) -> list[int]:
    # Starts with <s> like a tokenised prompt; the rest spread over the vocab deterministically.
    return [0] + [(salt * 131 + i * 97) % 1000 + 2 for i in range(length - 1)]


@pytest.fixture(scope="module")
def reference(tiny_model):
    model = LlamaForCausalLM.from_pretrained(tiny_model, dtype=torch.float64)
    model.generation_config.eos_token_id = None  # compare full lengths, even past an EOS
    return model


def reference_greedy(reference, tokens: list[int], new: int) -> list[int]:
    out = reference.generate(torch.tensor([tokens]), do_sample=False, max_new_tokens=new)
    return out[0, len(tokens) :].tolist()


def new_runner(tiny_model) -> ModelRunner:
    runner = ModelRunner(tiny_model, torch.float64, torch.device("cpu"), TensorParallel())
    runner.allocate_kv_cache(NUM_BLOCKS, BLOCK_SIZE)
    return runner


def test_continuous_batch_matches_transformers_greedy(tiny_model, reference):
    runner = Driver(new_runner(tiny_model))
    pool = BlockPool(NUM_BLOCKS)
    seqs = [Seq(i, prompt(n, i), n) for i, n in enumerate([3, 7, 12, 21])]
    chunked = Seq(10, prompt(30, 10), 30)
    late = Seq(11, prompt(9, 11), 9)
    runner.add([SequenceInit(s.seq_id, GREEDY, 0, s.tokens, s.prompt_len) for s in [*seqs, chunked]])
    new_tokens = 12

    # Step 0: four whole prompts and the first chunk of a fifth, in one batch.
    run_step(runner, pool, [(s, s.prompt_len) for s in seqs] + [(chunked, 16)])
    assert chunked.output == []  # a non-final chunk samples nothing
    # Step 1: decodes plus the rest of the chunked prompt.
    run_step(runner, pool, [(s, 1) for s in seqs] + [(chunked, 14)])
    step = 2
    while any(len(s.output) < new_tokens for s in [*seqs, chunked, late]):
        if step == 4:
            runner.add([SequenceInit(late.seq_id, GREEDY, 0, late.tokens, late.prompt_len)])
            # Joining between decodes: the prefill group's tokens are not contiguous in the step.
            decodes = [(s, 1) for s in [*seqs, chunked]]
            run_step(runner, pool, [*decodes[:2], (late, late.prompt_len), *decodes[2:]])
        else:
            live = [s for s in [*seqs, chunked] + ([late] if step > 4 else []) if len(s.output) < new_tokens]
            run_step(runner, pool, [(s, 1) for s in live])
        step += 1

    for s in [*seqs, chunked, late]:
        expected = reference_greedy(reference, s.tokens[: s.prompt_len], new_tokens)
        assert len(expected) == new_tokens
        assert s.output == expected, f"sequence {s.seq_id} (prompt of {s.prompt_len})"


def test_prefill_logits_and_logprobs_match_transformers(tiny_model, reference):
    runner = new_runner(tiny_model)
    pool = BlockPool(NUM_BLOCKS)
    seqs = [Seq(i, prompt(n, 20 + i), n) for i, n in enumerate([5, 1, 13, 8])]
    inp = plan(pool, [(s, s.prompt_len) for s in seqs])
    logits = forward_logits(runner, inp)
    start = 0
    for s in seqs:
        with torch.no_grad():
            want = reference(torch.tensor([s.tokens])).logits[0]
        torch.testing.assert_close(logits[start : start + s.prompt_len], want, rtol=1e-7, atol=1e-7)
        start += s.prompt_len

    # Through execute: the chosen token's logprob and the top 5 are transformers' log_softmax.
    runner2 = Driver(new_runner(tiny_model))
    runner2.add([SequenceInit(s.seq_id, GREEDY, 5, s.tokens, s.prompt_len) for s in seqs])
    out = runner2.execute(
        plan(BlockPool(NUM_BLOCKS), [(Seq(s.seq_id, s.tokens, s.prompt_len), s.prompt_len) for s in seqs])
    )
    for i, s in enumerate(seqs):
        with torch.no_grad():
            want = torch.log_softmax(reference(torch.tensor([s.tokens])).logits[0, -1], dim=-1)
        top = want.topk(5)
        assert out.token_ids[i] == top.indices[0].item()
        assert out.logprobs[i] == pytest.approx(top.values[0].item(), abs=1e-5)
        assert out.top_token_ids[5 * i : 5 * i + 5] == top.indices.tolist()
        assert out.top_logprobs[5 * i : 5 * i + 5] == pytest.approx(top.values.tolist(), abs=1e-5)


def _save_random(tmp_path, arch: str):
    from transformers import LlamaConfig, MistralConfig, MistralForCausalLM, Qwen2Config, Qwen2ForCausalLM

    shape = dict(
        vocab_size=300,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        initializer_range=0.2,
        eos_token_id=[1, 2],
    )
    if arch == "qwen2":  # q/k/v biases and tied embeddings
        model = Qwen2ForCausalLM(Qwen2Config(**shape, tie_word_embeddings=True))
    elif arch == "mistral":
        model = MistralForCausalLM(MistralConfig(**shape, sliding_window=None))
    else:  # Llama 3.1-style rope scaling, and biases on every attention projection
        rope = {
            "rope_type": "llama3",
            "rope_theta": 500000.0,
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
        }
        model = LlamaForCausalLM(LlamaConfig(**shape, attention_bias=True, rope_parameters=rope))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias"):
                p.normal_(0, 0.5)  # zero-initialised otherwise, which would not test that they load
    model.save_pretrained(tmp_path)
    return model.to(torch.float64)


@pytest.mark.parametrize("arch", ["qwen2", "mistral", "llama3_rope"])
def test_llama_family_variants_match_transformers(tmp_path, arch):
    torch.manual_seed(0)
    reference = _save_random(tmp_path, arch)
    runner = ModelRunner(tmp_path, torch.float64, torch.device("cpu"), TensorParallel())
    assert runner.describe()["eos_token_ids"] == [1, 2]
    runner.allocate_kv_cache(NUM_BLOCKS, BLOCK_SIZE)
    # Positions past original_max_position_embeddings exercise the scaled rope frequencies.
    seqs = [Seq(i, [t % 300 for t in prompt(n, i)], n) for i, n in enumerate([90, 7])]
    inp = plan(BlockPool(NUM_BLOCKS), [(s, s.prompt_len) for s in seqs])
    logits = forward_logits(runner, inp)
    with torch.inference_mode():
        want = torch.cat([reference(torch.tensor([s.tokens])).logits[0] for s in seqs])
    torch.testing.assert_close(logits, want, rtol=1e-7, atol=1e-7)


def test_missing_checkpoint_tensor_is_named(tiny_model, tmp_path):
    import shutil

    from safetensors.torch import load_file, save_file

    for f in tiny_model.iterdir():
        if f.suffix != ".safetensors":
            shutil.copy(f, tmp_path / f.name)
    tensors = load_file(tiny_model / "model.safetensors")
    del tensors["model.layers.1.self_attn.k_proj.weight"]
    save_file(tensors, tmp_path / "model.safetensors")
    with pytest.raises(ValueError, match=r"no tensor model\.layers\.1\.self_attn\.k_proj\.weight"):
        ModelRunner(tmp_path, torch.float32, torch.device("cpu"), TensorParallel())
