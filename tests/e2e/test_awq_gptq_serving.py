"""AWQ and GPTQ checkpoints through the real processes: the tiny model's linear layers quantized to
4 bits (asymmetric min-max, groups of 32: the tiny model's inputs are 64 and 128 wide) and written in each
format's documented packing (quant/awq.py pack_awq, quant/gptq.py pack_gptq, which the unit tests check
against bit-by-bit readers), served; greedy tokens must equal transformers' on the same weights
dequantized (a float checkpoint written alongside, float64 on both sides). AWQ at --tp 2 (column- and
row-parallel shards of packed words and group scales), GPTQ with desc_act (a random act-order g_idx
per layer input, shared by the layers that read the same input, as GPTQ writes it) with preemption
(--num-kv-blocks 16) and chunked prefill (--max-num-batched-tokens 64); other bit widths refused.
"""

from __future__ import annotations

import json
import shutil

import grpc
import torch
from safetensors.torch import load_file, save_file

from common.pb.tpserve.v1 import generation_pb2 as pb
from common.pb.tpserve.v1 import generation_pb2_grpc
from shard_worker.model.quant.awq import pack_awq
from shard_worker.model.quant.gptq import pack_gptq
from tests.conftest import launch
from tests.reference import assert_matches_reference, hf_greedy

GROUP = 32
LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
# Layers reading the same input share GPTQ's act order (it comes from that input's statistics).
SAME_INPUT = {"q_proj": "attn_in", "k_proj": "attn_in", "v_proj": "attn_in", "o_proj": "o_in",
              "gate_proj": "mlp_in", "up_proj": "mlp_in", "down_proj": "down_in"}  # fmt: skip


def quantize(w: torch.Tensor, g_idx: torch.Tensor, groups: int):
    """Asymmetric 4-bit min-max per (row, group): q [N, K], scale and zero [N, G] (zero 1..15, which
    GPTQ v1 can store; scale rounded to fp16 as both formats store it)."""
    n = w.shape[0]
    scale, zero = torch.empty(n, groups), torch.empty(n, groups)
    q = torch.empty(w.shape, dtype=torch.uint8)
    for j in range(groups):
        cols = (g_idx == j).nonzero().flatten()
        block = w[:, cols]
        lo, hi = block.amin(1).clamp(max=0), block.amax(1).clamp(min=0)
        s = ((hi - lo) / 15).clamp(min=1e-6).half().float()
        z = torch.round(-lo / s).clamp(1, 15)
        scale[:, j], zero[:, j] = s, z
        q[:, cols] = torch.round(block / s[:, None] + z[:, None]).clamp(0, 15).to(torch.uint8)
    return q, scale, zero


def write_checkpoints(src, quantized_dir, reference_dir, fmt: str, desc_act: bool = False):
    """The quantized checkpoint and the float checkpoint of its dequantized weights."""
    tensors = load_file(src / "model.safetensors")
    config = json.loads((src / "config.json").read_text())
    quantized, reference = {}, dict(tensors)
    gen = torch.Generator().manual_seed(7)
    orders = {}
    for name, w in tensors.items():
        module = name.rsplit(".", 2)
        if len(module) < 3 or module[1] not in LINEARS or module[2] != "weight":
            quantized[name] = w
            continue
        prefix, proj = name[: -len(".weight")], module[1]
        k = w.shape[1]
        groups = k // GROUP
        g_idx = torch.arange(k) // GROUP
        if desc_act:
            layer_input = name.split(".self_attn")[0].split(".mlp")[0] + SAME_INPUT[proj]
            order = orders.setdefault(layer_input, torch.randperm(k, generator=gen))
            g_idx = torch.empty(k, dtype=torch.int64)
            g_idx[order] = torch.arange(k) // GROUP
        q, scale, zero = quantize(w.double(), g_idx, groups)
        dequantized = (q.double() - zero[:, g_idx]) * scale[:, g_idx]
        reference[name] = dequantized.to(w.dtype)
        packed = pack_awq(q, scale, zero, GROUP) if fmt == "awq" else pack_gptq(q, scale, zero, GROUP, g_idx)
        quantized.update({f"{prefix}.{key}": value for key, value in packed.items()})
    if fmt == "awq":
        qc = {"quant_method": "awq", "bits": 4, "group_size": GROUP, "zero_point": True, "version": "gemm"}
    else:
        qc = {"quant_method": "gptq", "bits": 4, "group_size": GROUP, "desc_act": desc_act, "sym": False,
              "checkpoint_format": "gptq"}  # fmt: skip
    for out, weights, extra in (
        (quantized_dir, quantized, {"quantization_config": qc}),
        (reference_dir, reference, {}),
    ):
        out.mkdir(parents=True)
        save_file(weights, out / "model.safetensors", metadata={"format": "pt"})
        (out / "config.json").write_text(json.dumps({**config, **extra}))
        for extra_file in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
            if (src / extra_file).exists():
                shutil.copy(src / extra_file, out / extra_file)
    return quantized_dir, reference_dir


def serve_and_compare(model, reference_dir, *flags):
    reference = hf_greedy(reference_dir)
    with launch(model, "--dtype", "float64", *flags) as (target, _), grpc.insecure_channel(target) as ch:
        stub = generation_pb2_grpc.GenerationStub(ch)
        assert_matches_reference(stub, reference)
        return stub.GetStats(pb.StatsRequest())


def test_awq_at_tp2_equals_transformers_on_the_dequantized_weights(tiny_model, tmp_path):
    model, ref = write_checkpoints(tiny_model, tmp_path / "awq", tmp_path / "awq-ref", "awq")
    serve_and_compare(model, ref, "--tp", "2")


def test_gptq_desc_act_equals_transformers_under_preemption(tiny_model, tmp_path):
    model, ref = write_checkpoints(
        tiny_model, tmp_path / "gptq", tmp_path / "gptq-ref", "gptq", desc_act=True
    )
    stats = serve_and_compare(model, ref, "--num-kv-blocks", "16", "--max-num-batched-tokens", "64")
    assert stats.num_preemptions_total > 0
