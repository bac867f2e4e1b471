"""The unquantized method: a plain [out, in] weight in the model's dtype, optionally held in bfloat16
(--linear-dtype) and, on CPU, repacked for our own linear kernel (cpu_linear.py) or else prepacked for
oneDNN; and the plain MoE experts."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from shard_worker.model.quant import cpu_linear
from shard_worker.model.quant.base import ExpertMethod, LinearMethod, add_param, replace_param


class UnquantizedLinearMethod(LinearMethod):
    def __init__(
        self, linear_dtype: torch.dtype | None = None, prepack: bool = False, own_kernel: bool = True
    ):
        """linear_dtype: the dtype the weight is held and multiplied in, if not the model's. bfloat16 on a
        CPU with native bf16 products (AVX-512 BF16, AMX) halves the bytes a decode step reads and runs
        the products at the bf16 rate; the input is rounded to it for the product and the product comes
        back in the input's dtype, so the residual stream, norms, attention and KV cache keep theirs.
        prepack: on CPU, repack the weight once for cpu_linear's kernel (float32 and bfloat16 weights
        where this CPU multiplies them with vector instructions: AVX-512 BF16 for bfloat16, AVX-512F or
        AVX2 + FMA for float32); `weight` then holds that layout, `layer.cpu_packed` describes it. It
        streams weights near the memory's rate at decode batch sizes and keeps up with oneDNN on
        prefill (bench/cpu_linear.py). Otherwise (no compiler, another CPU, float16) reorder it
        once into oneDNN's blocked layout so that no product reorders it per call (what inductor's
        frozen CPU graphs and vLLM's CPU linear do). oneDNN's packing against plain weights, a whole
        SmolLM2-135M decode step at one thread (bench/decode_profile.py --linear, AVX-512-BF16 machine),
        plain / packed: float32 weights 1.9x faster at batch 1, 2.0x at 8, 1.6-1.9x at 32; bfloat16
        weights 1.9x, 1.15x, 1.15-1.3x. bfloat16 products are bit-identical to F.linear's, float32 ones
        differ by float32 rounding (another summation order). own_kernel False: oneDNN's layout even
        where our kernel builds (encoders: every product has a whole prompt's rows). all-MiniLM-L6-v2's
        six layers over 512 sentences of 8-130 tokens, two threads, Xeon with AMX: bfloat16 3.8 s with
        our kernel, 0.95 s with oneDNN's; float32 3.5 s and 3.1 s."""
        self.linear_dtype = linear_dtype
        self.prepack = prepack
        self.own_kernel = own_kernel
        # Set by load_model on a CPU with AMX when the copy fits (both_layouts_fit): bfloat16 weights are
        # also held in oneDNN's layout, which from ONEDNN_ROWS rows multiplies on AMX tiles.
        self.both_layouts = False

    def create_weights(self, layer, input_size_per_partition, output_partition_sizes, params_dtype):
        add_param(
            layer,
            "weight",
            (sum(output_partition_sizes), input_size_per_partition),
            params_dtype,
            output_dim=0,
            input_dim=1,
        )

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        weight = layer.weight.detach()
        if self.linear_dtype is not None and weight.dtype != self.linear_dtype:
            # A tied LM head gets its own copy: the embedding stays exact.
            weight = weight.to(self.linear_dtype)
        cpu = self.prepack and weight.device.type == "cpu"
        if cpu and self.own_kernel and cpu_linear.available(weight.dtype):
            # The parameter holds the kernel's layout (so loaders and weight_bytes still see it, once); a
            # tied head gets its own, the embedding keeps its plain weight.
            layer.cpu_packed = cpu_linear.PackedLinear.pack(weight)
            replace_param(layer, "weight", layer.cpu_packed.data)
            if self.both_layouts and weight.dtype == torch.bfloat16:
                layer.onednn_weight = torch.ops.mkldnn._reorder_linear_weight(
                    weight
                )  # weight_bytes counts it
            return
        if cpu and weight.dtype in _packable_dtypes():
            weight = torch.ops.mkldnn._reorder_linear_weight(weight)
        if weight is not layer.weight.detach():
            replace_param(layer, "weight", weight)

    def apply(self, layer, x, bias=None):
        packed = getattr(layer, "cpu_packed", None)
        if packed is None:
            return linear(x, layer.weight, bias)
        onednn = getattr(layer, "onednn_weight", None)
        if (
            onednn is not None
            and x.dtype == onednn.dtype
            and (bias is None or bias.dtype == x.dtype)
            and x.numel() >= ONEDNN_ROWS * x.shape[-1]
        ):
            return _product(x, onednn, bias)
        if x.dtype in cpu_linear.CODES and x.device.type == "cpu":
            return cpu_linear.linear(x, packed, bias)
        return linear(x, packed.unpack(), bias)  # another dtype (float64 tests): correct, slow


# With both layouts (UnquantizedLinearMethod.both_layouts), products of this many rows or more go to
# oneDNN's. Single products, two threads, Xeon with AMX, bfloat16, SmolLM2's and all-MiniLM's shapes, ms
# ours / oneDNN's: 1 row 0.021-0.040 / 0.045-0.091, 4 rows 0.035-0.064 / 0.050-0.079, 8 rows 0.056-0.117
# / 0.040-0.090, 32 rows 0.17-0.40 / 0.067-0.127. Whole SmolLM2-135M decode steps (bench.decode_profile,
# ours only / oneDNN only): batch 8 35.5 / 40-43 ms, 12 48-52 / 41-47, 16 59 / 45-49, 32 96 / 59-63.
ONEDNN_ROWS = 12
# The share of the memory available at load that oneDNN's second copy of the bfloat16 linear weights may
# take (both_layouts_fit): SmolLM2-135M's 0.2 GB, a 1.7B model's 3.2 GB fit in 24 GB; an 8B model's do not.
BOTH_LAYOUTS_SHARE = 0.2


def both_layouts_fit(nbytes: int, meminfo: str = "/proc/meminfo") -> bool:
    """Whether a second copy of nbytes of bfloat16 linear weights in oneDNN's layout is worth holding: a
    CPU with AMX (cpu_linear.amx_bf16), and the copy within BOTH_LAYOUTS_SHARE of MemAvailable."""
    if not cpu_linear.amx_bf16():
        return False
    try:
        with open(meminfo) as f:
            line = next(x for x in f if x.startswith("MemAvailable:"))
    except (OSError, StopIteration):
        return False
    return nbytes <= BOTH_LAYOUTS_SHARE * int(line.split()[1]) * 1024


def _packable_dtypes() -> set[torch.dtype]:
    # oneDNN's float32 and bfloat16 (where the CPU multiplies it natively); none without oneDNN.
    if not torch.backends.mkldnn.is_available():
        return set()
    bf16 = torch.ops.mkldnn._is_mkldnn_bf16_supported()
    return {torch.float32, torch.bfloat16} if bf16 else {torch.float32}


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x W^T + b. With W held in a narrower dtype than x, x is rounded to W's dtype for the product and
    the product comes back in x's. W may be prepacked for oneDNN."""
    if weight.dtype == x.dtype:
        return _product(x, weight, bias)
    y = _product(x.to(weight.dtype), weight, None).to(x.dtype)
    return y if bias is None else y + bias


def _product(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    if weight.is_mkldnn:
        return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")
    return F.linear(x, weight, bias)


class UnquantizedExpertMethod(ExpertMethod):
    """gate_up_proj [E, 2 * I / tp, H] (each expert's [gate shard; up shard]) and down_proj [E, H, I / tp],
    named like transformers' stacked experts; one grouped matmul for gate/up and one for down over all
    experts (F.grouped_mm), or a loop over the experts that received rows where grouped_mm does not take
    the operands (float64, which the end-to-end tests run in)."""

    def create_weights(self, layer, num_experts, hidden_size, local_intermediate, params_dtype):
        gate_up = add_param(
            layer, "gate_up_proj", (num_experts, 2 * local_intermediate, hidden_size), params_dtype
        )
        down = add_param(layer, "down_proj", (num_experts, hidden_size, local_intermediate), params_dtype)
        gate_up.weight_loader = layer.load_gate_up
        down.weight_loader = layer.load_down
        # Filled one checkpoint tensor at a time: (expert, 0 gate | 1 up) and (expert, None) for down.
        gate_up.checkpoint_parts = tuple((e, s) for e in range(num_experts) for s in (0, 1))
        down.checkpoint_parts = tuple((e, None) for e in range(num_experts))

    def apply(self, layer, xs: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """The experts' outputs for rows xs sorted by expert, counts[e] rows for expert e (with the
        layer's biases when it has them: rank 0 alone adds down's, which the all-reduce then sums once)."""
        from shard_worker.model.layers.moe import grouped_mm_supported

        gate_up_bias, down_bias = layer.gate_up_proj_bias, layer.down_proj_bias
        if down_bias is not None and layer.tp.rank != 0:
            down_bias = None
        if grouped_mm_supported(xs, xs.shape[1], layer.local_intermediate):
            offsets = counts.cumsum(0).to(torch.int32)
            gate_up = F.grouped_mm(xs, layer.gate_up_proj.transpose(1, 2), offs=offsets)
            row_experts = None
            if gate_up_bias is not None or down_bias is not None:
                experts = torch.arange(len(counts), device=xs.device)
                row_experts = experts.repeat_interleave(counts, output_size=xs.shape[0])
            if gate_up_bias is not None:
                gate_up = gate_up + gate_up_bias.index_select(0, row_experts)
            gate, up = gate_up.chunk(2, dim=-1)
            ys = F.grouped_mm(layer.gated(gate, up), layer.down_proj.transpose(1, 2), offs=offsets)
            return ys if down_bias is None else ys + down_bias.index_select(0, row_experts)
        ys = torch.empty(xs.shape[0], layer.down_proj.shape[1], dtype=xs.dtype, device=xs.device)
        start = 0
        for expert, n in enumerate(counts.tolist()):  # one host read per layer
            if n:
                rows = slice(start, start + n)
                b1 = None if gate_up_bias is None else gate_up_bias[expert]
                b2 = None if down_bias is None else down_bias[expert]
                gate, up = F.linear(xs[rows], layer.gate_up_proj[expert], b1).chunk(2, dim=-1)
                ys[rows] = F.linear(layer.gated(gate, up), layer.down_proj[expert], b2)
                start += n
        return ys
