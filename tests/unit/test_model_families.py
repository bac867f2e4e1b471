"""Every family through ModelRunner, in float64, against transformers' generate: each family's checkpoint
(tests/model_families.py) loads with every tensor mapped and none missing, and decodes the same greedy
tokens with prompts chunked over several steps beside other sequences' decodes. The served path (the
real processes, preemption, tensor parallelism) is tests/e2e/test_family_serving.py."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from shard_worker.model.loader import _checkpoint_name, param_name
from shard_worker.step import SequenceInit
from tests.model_families import FAMILIES, build_checkpoint, hf_greedy, prompts
from tests.unit.greedy import NUM_BLOCKS, new_runner
from tests.unit.greedy import hf_greedy as hf_greedy_model
from tests.unit.test_model_runner import BLOCK_SIZE, GREEDY, BlockPool, Driver, Seq, run_step

torch.set_flush_denormal(True)

NEW_TOKENS = 12
CHUNK = 13  # prefill tokens per sequence per step: prompts take several steps, next to decodes


@pytest.fixture(scope="module", params=FAMILIES)
def checkpoint(request, tmp_path_factory):
    family = request.param
    return family, build_checkpoint(family, tmp_path_factory.mktemp(family))


def chunked_greedy(runner, prompt_list: list[list[int]], new_tokens: int) -> list[list[int]]:
    """Each step computes up to CHUNK more prompt tokens of each sequence, or one decode token."""
    runner.allocate_kv_cache(NUM_BLOCKS, BLOCK_SIZE)
    pool = BlockPool(NUM_BLOCKS)
    seqs = [Seq(i, list(p), len(p)) for i, p in enumerate(prompt_list)]
    driver = Driver(runner)
    driver.add([SequenceInit(s.seq_id, GREEDY, 0, s.tokens, s.prompt_len) for s in seqs])
    while any(len(s.output) < new_tokens for s in seqs):
        chunks = [(s, min(CHUNK, len(s.tokens) - s.num_computed)) for s in seqs if len(s.output) < new_tokens]
        run_step(driver, pool, chunks)
    return [s.output for s in seqs]


def test_family_decodes_like_transformers(checkpoint):
    family, path = checkpoint
    runner = new_runner(path, torch.float64)
    assert type(runner.model).__name__ == json.loads((path / "config.json").read_text())["architectures"][0]
    reference = hf_greedy(path, NEW_TOKENS)
    assert chunked_greedy(runner, prompts(), NEW_TOKENS) == list(reference.values())


@pytest.mark.parametrize(
    "family,backend", [("gemma3", "auto"), ("gemma3", "flex"), ("mixtral", "auto"), ("gpt_oss", "auto")]
)
def test_float32_decodes_like_transformers(tmp_path, family, backend):
    """The production paths the float64 tests do not take: the CPU attention kernel (auto's choice) and
    the compiled flex attention, with sliding windows, and the experts' grouped matmul (gpt-oss: the
    kernel's sinks, the biased experts)."""
    from transformers import AutoModelForCausalLM

    path = build_checkpoint(family, tmp_path)
    runner = new_runner(path, torch.float32, backend)
    assert runner.attention.name == ("cpu" if backend == "auto" else backend)
    reference = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    want = hf_greedy_model(reference, prompts(), NEW_TOKENS)
    assert chunked_greedy(runner, prompts(), NEW_TOKENS) == want


def test_every_checkpoint_tensor_maps_to_a_parameter_and_back(checkpoint):
    """param_name and the loader's error naming (its inverse) agree on every tensor of the checkpoint."""
    family, path = checkpoint
    runner = new_runner(path, torch.float32)
    mapping = runner.model.packed_modules_mapping
    params = dict(runner.model.named_parameters(remove_duplicate=False))
    with safe_open(path / "model.safetensors", "pt") as f:
        names = list(f.keys())  # noqa: SIM118 (not iterable)
    for ckpt_name in names:
        name, part = param_name(ckpt_name, mapping)
        assert name in params, ckpt_name
        assert _checkpoint_name(name, part, mapping) == ckpt_name


def test_a_missing_tensor_is_named(checkpoint, tmp_path):
    """The last tensor of each kind that merges (an expert's, a q/k/v or fused one) removed: the loader
    names exactly it."""
    family, path = checkpoint
    with safe_open(path / "model.safetensors", "pt") as f:
        tensors = {name: f.get_tensor(name) for name in f.keys()}  # noqa: SIM118
    for victim in [n for n in tensors if ".experts." in n][-1:] + [n for n in tensors if "_proj" in n][-1:]:
        for name in path.glob("*.json"):
            (tmp_path / name.name).write_text(name.read_text())
        save_file({n: t for n, t in tensors.items() if n != victim}, tmp_path / "model.safetensors")
        with pytest.raises(ValueError, match=f"has no tensor {victim} "):
            new_runner(tmp_path, torch.float32)


def test_a_tensor_the_model_does_not_have_is_named(checkpoint, tmp_path):
    """Nothing is left unread: a stray tensor, or an expert beyond num_experts, stops the load."""
    family, path = checkpoint
    with safe_open(path / "model.safetensors", "pt") as f:
        tensors = {name: f.get_tensor(name) for name in f.keys()}  # noqa: SIM118
    experts = sorted(n for n in tensors if ".experts.0." in n)
    strays = ["model.layers.0.extra_norm.weight"] + [
        n.replace(".experts.0.", ".experts.99.") for n in experts[:1]
    ]
    for stray in strays:
        for name in path.glob("*.json"):
            (tmp_path / name.name).write_text(name.read_text())
        save_file({**tensors, stray: torch.zeros(4)}, tmp_path / "model.safetensors")
        with pytest.raises(ValueError, match=f"tensor {stray} matches no "):
            new_runner(tmp_path, torch.float32)


def test_qwen3_5_vision_language_checkpoint_serves_its_text_model(tmp_path):
    """Qwen3.5's released layout (Qwen3_5ForConditionalGeneration: a text_config, the text model's
    tensors under model.language_model., a vision tower and an MTP layer beside them) decodes what the
    same text model does on its own."""
    import shutil

    from transformers import Qwen3_5Config

    text = build_checkpoint("qwen3_5", tmp_path / "text")
    vl = tmp_path / "vl"
    config = Qwen3_5Config(text_config=json.loads((text / "config.json").read_text()))
    config.architectures = ["Qwen3_5ForConditionalGeneration"]
    config.save_pretrained(vl)
    shutil.copy(text / "generation_config.json", vl)
    with safe_open(text / "model.safetensors", "pt") as f:
        tensors = {
            name.replace("model.", "model.language_model.", 1): f.get_tensor(name)
            for name in f.keys()  # noqa: SIM118 (not iterable)
        }
    tensors["model.visual.patch_embed.proj.weight"] = torch.zeros(2, 2)
    tensors["mtp.fc.weight"] = torch.zeros(2, 2)
    save_file(tensors, vl / "model.safetensors")
    served = chunked_greedy(new_runner(vl, torch.float64), prompts(), 6)
    assert served == chunked_greedy(new_runner(text, torch.float64), prompts(), 6)
