"""Mixture of experts: a replicated router, top-k routing, and every expert's gated MLP in one batched
computation per layer.

Sharding: each rank holds a slice of every expert's intermediate features (gate/up rows, down columns),
not whole experts. Every rank then does the same work whatever the routing (with whole experts per rank,
the rank holding the popular experts sets the pace and the others wait in the all-reduce), the layer ends
with the one all-reduce a dense MLP has, and any number of experts works with any tensor-parallel size.
The cost is smaller matmuls per rank for fine-grained experts at large TP (Qwen3-30B-A3B: 768 / 8 = 96
features), where expert parallelism would be the better split.

The expert computation: the step's (token, slot) pairs are sorted by expert once, so each expert's rows
are contiguous; then one grouped matmul for gate/up and one for down over all experts at once
(F.grouped_mm, which takes the group boundaries as offsets: float32 and half types), or, where it is not
available (float64, which the end-to-end tests run in), a loop over the experts that received
rows. Either way the work is the tokens' own: an expert no token chose costs nothing beyond holding its
weights, so at fixed top-k the time does not grow with the number of experts except through the weights
it reads.
"""

from __future__ import annotations

import torch
from torch import nn

from shard_worker.model.layers.linear import ReplicatedLinear, copy_checked, divide
from shard_worker.model.layers.mlp import ACTIVATIONS
from shard_worker.model.quant.base import bind_now_or_later
from shard_worker.parallel import TensorParallel


def route(
    router_logits: torch.Tensor, top_k: int, renormalize: bool, weights_dtype: torch.dtype | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights [T, k], expert ids [T, k]) as transformers routes: a float32 softmax over all experts,
    the top k, renormalised to sum to one when asked (Mixtral always, which equals a softmax over the top
    k logits; Qwen3-MoE when norm_topk_prob), then cast to weights_dtype (None: kept in float32)."""
    probs = torch.softmax(router_logits.float(), dim=-1)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return (weights if weights_dtype is None else weights.to(weights_dtype)), ids


def route_top_k_softmax(router_logits: torch.Tensor, top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights [T, k], expert ids [T, k]) as gpt-oss routes: the top k logits, then a softmax over just
    those, in the logits' dtype."""
    logits, ids = torch.topk(router_logits, top_k, dim=-1)
    return torch.softmax(logits, dim=-1), ids


def grouped_mm_supported(x: torch.Tensor, *row_sizes: int) -> bool:
    """Whether F.grouped_mm takes these operands: CPU float32 and half types, CUDA bfloat16 on Ampere and
    later (as transformers uses it; not verified on a device here yet); and every row (hidden,
    intermediate) a multiple of 16 bytes."""
    if any(n * x.element_size() % 16 for n in row_sizes):
        return False
    if x.device.type == "cpu":
        return x.dtype in (torch.float32, torch.bfloat16, torch.float16)
    if x.device.type == "cuda":
        return x.dtype == torch.bfloat16 and torch.cuda.get_device_capability(x.device) >= (8, 0)
    return False


class FusedMoE(nn.Module):
    """num_experts gated MLPs, their weights stacked and held by an expert method (quant/base.py; the
    unquantized one: gate_up_proj [E, 2 * I / tp, H], each expert's [gate shard; up shard], and down_proj
    [E, H, I / tp]). Each parameter is named like transformers' stacked experts; the loader fills it one
    checkpoint tensor at a time, part (expert, 0 gate | 1 up) and (expert, None) for down.

    bias: each expert's gate/up and down biases besides (gate_up_proj_bias [E, 2 * I / tp], split like
    its rows; down_proj_bias [E, H], whole, added by rank 0 only, before the all-reduce)."""

    def __init__(
        self,
        num_experts: int,
        hidden_size: int,
        intermediate_size: int,
        activation: str,
        tp: TensorParallel,
        bias: bool = False,
    ):
        super().__init__()
        self.tp = tp
        self.num_experts = num_experts
        self.hidden_size = hidden_size
        self.local_intermediate = divide(intermediate_size, tp.world_size, "expert intermediate features")
        self.act = ACTIVATIONS.get(activation)
        self.gate_up_proj_bias = self.down_proj_bias = None
        if bias:
            n = self.local_intermediate
            self.gate_up_proj_bias = nn.Parameter(torch.empty(num_experts, 2 * n), requires_grad=False)
            self.down_proj_bias = nn.Parameter(torch.empty(num_experts, hidden_size), requires_grad=False)
        self.quant_method = None
        bind_now_or_later(self)

    def gated(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        """The gated activation between gate/up and down: act(gate) * up."""
        return self.act(gate) * up

    def default_method(self):
        from shard_worker.model.quant.unquantized import UnquantizedExpertMethod

        return UnquantizedExpertMethod()

    def set_method(self, method) -> None:
        self.quant_method = method
        method.create_weights(
            self, self.num_experts, self.hidden_size, self.local_intermediate, torch.get_default_dtype()
        )

    def load_gate_up(self, param: nn.Parameter, source, part: tuple[int, int]) -> None:
        expert, shard = part
        n = self.local_intermediate
        start = self.tp.rank * n
        copy_checked(
            param.data[expert, shard * n : (shard + 1) * n], source, slice(start, start + n), "expert"
        )

    def load_down(self, param: nn.Parameter, source, part: tuple[int, None]) -> None:
        start = self.tp.rank * self.local_intermediate
        index = (slice(None), slice(start, start + self.local_intermediate))
        copy_checked(param.data[part[0]], source, index, "expert down_proj")

    def forward(self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor) -> torch.Tensor:
        """This rank's partial sum (before the all-reduce) of sum_j weight_j * expert_j(x), per token.
        x [T, H]; topk_ids and topk_weights [T, k]."""
        k = topk_ids.shape[1]
        flat = topk_ids.flatten()
        order = flat.argsort(stable=True)  # (token, slot) pairs, grouped by expert
        rows = order // k  # the token of each
        counts = torch.bincount(flat, minlength=self.num_experts)
        ys = self.quant_method.apply(self, x.index_select(0, rows), counts)
        # Weighted in the weights' dtype and then cast, as transformers does (Mixtral keeps float32).
        weights = topk_weights.flatten().index_select(0, order)
        ys = (ys * weights.unsqueeze(1)).to(x.dtype)
        return torch.zeros_like(x).index_add_(0, rows, ys)


class SparseMoE(nn.Module):
    """Router (`gate`, replicated) + experts; the output all-reduced once, like a row-parallel layer."""

    def __init__(
        self,
        hidden_size: int,
        intermediate_size: int,
        num_experts: int,
        top_k: int,
        activation: str,
        tp: TensorParallel,
        renormalize: bool,
        weights_in_model_dtype: bool,
    ):
        super().__init__()
        self.tp = tp
        self.top_k = top_k
        self.renormalize = renormalize
        self.weights_in_model_dtype = weights_in_model_dtype
        self.gate = ReplicatedLinear(hidden_size, num_experts)
        self.experts = FusedMoE(num_experts, hidden_size, intermediate_size, activation, tp)

    def forward_partial(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype if self.weights_in_model_dtype else None
        weights, ids = route(self.gate(x), self.top_k, self.renormalize, dtype)
        return self.experts(x, ids, weights)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.tp.all_reduce(self.forward_partial(x))


def clamped_swiglu(gate: torch.Tensor, up: torch.Tensor, alpha: float, limit: float) -> torch.Tensor:
    """gpt-oss's gated activation: gate clamped above at limit, up to [-limit, limit], then
    (up + 1) * gate * sigmoid(alpha * gate)."""
    gate = gate.clamp(max=limit)
    up = up.clamp(min=-limit, max=limit)
    return (up + 1) * (gate * torch.sigmoid(gate * alpha))


def deinterleave(t: torch.Tensor, dim: int) -> torch.Tensor:
    """Rows g0 u0 g1 u1 ... along dim (gpt-oss's fused gate/up) as g0 g1 ... u0 u1 ... (ours)."""
    index = [slice(None)] * t.dim()
    gates, ups = list(index), list(index)
    gates[dim], ups[dim] = slice(0, None, 2), slice(1, None, 2)
    return torch.cat([t[tuple(gates)], t[tuple(ups)]], dim=dim)


class GptOssExperts(FusedMoE):
    """gpt-oss's experts: biased, the clamped SwiGLU, and a checkpoint that stacks every expert in one
    tensor per kind, transposed (gate_up_proj [E, H, 2 * I], down_proj [E, I, H]) with gate and up
    interleaved along the features. Each rank reads its features' columns and lays them out as FusedMoE
    holds them. (quant/mxfp4.py reads the MXFP4 form of the same tensors.)"""

    def __init__(self, num_experts, hidden_size, intermediate_size, tp, alpha: float, limit: float):
        self.alpha, self.limit = alpha, limit
        super().__init__(num_experts, hidden_size, intermediate_size, "clamped_swiglu", tp, bias=True)
        self.gate_up_proj_bias.weight_loader = self.load_gate_up_bias
        self.down_proj_bias.weight_loader = self.load_down_bias

    def gated(self, gate, up):
        return clamped_swiglu(gate, up, self.alpha, self.limit)

    def set_method(self, method) -> None:
        super().set_method(method)
        for name, loader in (
            ("gate_up_proj", self.load_stacked_gate_up),
            ("down_proj", self.load_stacked_down),
        ):
            param = getattr(self, name, None)
            if param is not None and getattr(param, "weight_loader", None) in (
                self.load_gate_up,
                self.load_down,
            ):
                param.weight_loader, param.checkpoint_parts = loader, (None,)

    def feature_columns(self) -> slice:
        """This rank's columns of the interleaved gate/up features."""
        n = self.local_intermediate
        return slice(2 * self.tp.rank * n, 2 * (self.tp.rank + 1) * n)

    def feature_rows(self) -> slice:
        """This rank's rows of the intermediate features (down's input)."""
        n = self.local_intermediate
        return slice(self.tp.rank * n, (self.tp.rank + 1) * n)

    def load_stacked_gate_up(self, param, source, part=None) -> None:
        tensor = source[:, :, self.feature_columns()]  # [E, H, 2n], interleaved
        copy_checked(param.data, deinterleave(tensor, 2).transpose(1, 2), ..., "experts.gate_up_proj")

    def load_stacked_down(self, param, source, part=None) -> None:
        tensor = source[:, self.feature_rows(), :]  # [E, n, H]
        copy_checked(param.data, tensor.transpose(1, 2), ..., "experts.down_proj")

    def load_gate_up_bias(self, param, source, part=None) -> None:
        copy_checked(
            param.data, deinterleave(source[:, self.feature_columns()], 1), ..., "experts.gate_up_proj_bias"
        )

    def load_down_bias(self, param, source, part=None) -> None:
        copy_checked(param.data, source, ..., "experts.down_proj_bias")


class GptOssMoE(nn.Module):
    """gpt-oss's MLP: a biased router (`router`, replicated; route_top_k_softmax) and GptOssExperts, the
    output all-reduced once."""

    def __init__(self, hidden_size, intermediate_size, num_experts, top_k, tp, alpha: float, limit: float):
        super().__init__()
        self.tp = tp
        self.top_k = top_k
        self.router = ReplicatedLinear(hidden_size, num_experts, bias=True)
        self.experts = GptOssExperts(num_experts, hidden_size, intermediate_size, tp, alpha, limit)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = route_top_k_softmax(self.router(x), self.top_k)
        return self.tp.all_reduce(self.experts(x, ids, weights))


def route_grouped(
    router_logits: torch.Tensor,
    correction_bias: torch.Tensor,
    top_k: int,
    num_groups: int,
    topk_group: int,
    renormalize: bool,
    scaling: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights [T, k] float32, expert ids [T, k]) as DeepSeek-V3 routes (noaux_tc), in transformers'
    arithmetic: sigmoid scores; the correction bias added for choosing only; the experts split into
    num_groups groups, each group scored by its two best biased scores, the topk_group best groups kept;
    the top k biased experts among them; weighted by their unbiased scores, renormalised when asked,
    times scaling (routed_scaling_factor)."""
    scores = router_logits.float().sigmoid()
    choice = scores + correction_bias.float()
    tokens, experts = scores.shape
    grouped = choice.view(tokens, num_groups, experts // num_groups)
    group_scores = grouped.topk(2, dim=-1)[0].sum(dim=-1)
    groups = torch.topk(group_scores, k=topk_group, dim=-1, sorted=False)[1]
    kept = torch.zeros_like(group_scores).scatter_(1, groups, 1).bool()
    kept = kept[:, :, None].expand(grouped.shape).reshape(tokens, experts)
    ids = torch.topk(choice.masked_fill(~kept, float("-inf")), k=top_k, dim=-1, sorted=False)[1]
    weights = scores.gather(1, ids)
    if renormalize:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return weights * scaling, ids


class GroupLimitedRouter(nn.Module):
    """DeepSeek-V3's router (`gate`): a float32 weight and correction bias, replicated, logits in float32
    whatever the model dtype (transformers keeps both in float32 too)."""

    def __init__(self, hidden_size: int, num_experts: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_experts, hidden_size, dtype=torch.float32), False)
        self.e_score_correction_bias = nn.Parameter(torch.empty(num_experts, dtype=torch.float32), False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.linear(x.float(), self.weight)
