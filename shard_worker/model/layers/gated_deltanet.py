"""Gated DeltaNet linear attention (Qwen3-Next's `linear_attn`), in torch, with its state carried across
steps in a fixed slot per sequence.

A layer keeps, per sequence, two things instead of keys and values per token: the last kernel - 1 inputs
of its short causal convolution (conv state, [channels, kernel - 1]) and the delta rule's state
(S, [value heads, key dim, value dim], float32). Each token t decays S by exp(g_t), replaces what S
recalls for k_t by v_t at rate beta_t (S += k_t (beta_t (v_t - S^T k_t))^T) and reads o_t = S^T q_t.

- A prefill (or a chunk of one: chunked prefill) runs the chunked form: within a chunk of 64 tokens the
  updates are folded into one triangular solve (the WY / UT transform), and S moves once per chunk.
- A decode token runs the recurrent form directly, every decoding sequence of the step at once.
Both start from the state in the sequence's slot (zeros where the step begins at position 0) and write
the new state back, so a chunked prefill continues exactly where its last chunk stopped, and a
sequence recomputed after preemption starts afresh.

Arithmetic follows transformers' torch fallbacks (modeling_qwen3_next.py): the rule in float32 whatever
the model dtype, q and k L2-normalised there, q scaled by key_dim ** -0.5; the convolution in the weight
dtype. Tensor parallelism splits the heads: each rank holds whole key heads and the value heads that
share them, its slice of every projection, of the convolution's channels and of the per-head decay
parameters; out_proj is row-parallel (the layer's one all-reduce).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from shard_worker.model.layers.linear import (
    ColumnParallelLinear,
    MergedColumnParallelLinear,
    RowParallelLinear,
    divide,
    new_param,
)
from shard_worker.parallel import TensorParallel

CHUNK = 64


# ---- the maths, on plain tensors ----


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + eps)


def causal_conv(
    x: torch.Tensor, state: torch.Tensor, weight: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """One sequence's tokens x [T, C] through the depthwise causal convolution (weight [C, K]) that has
    seen `state` [C, K - 1] before them, then silu. Returns (out [T, C] in x's dtype, new state)."""
    kernel = weight.shape[1]
    window = torch.cat([state.to(weight.dtype), x.t().to(weight.dtype)], dim=1)  # [C, K - 1 + T]
    # Each output sums kernel products: as a product with the sliding windows (F.conv1d's depthwise CPU
    # path took 0.7 s for 128 channels of 30 tokens in float64 on a loaded machine).
    out = (window.unfold(1, kernel, 1) * weight.unsqueeze(1)).sum(-1)  # [C, T]
    return F.silu(out).t().to(x.dtype), window[:, -(kernel - 1) :]


def causal_conv_step(
    x: torch.Tensor, state: torch.Tensor, weight: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """One token for each of S sequences: x [S, C], state [S, C, K - 1]. Returns (out [S, C], new state)."""
    window = torch.cat([state.to(weight.dtype), x.unsqueeze(2).to(weight.dtype)], dim=2)  # [S, C, K]
    out = (window * weight.unsqueeze(0)).sum(-1)
    return F.silu(out).to(x.dtype), window[:, :, 1:]


def _prepare(q, k, v, g, beta):
    """To float32, heads first where the caller wants, q/k normalised, q scaled; key heads repeated for
    the value heads that share them."""
    ratio = v.shape[-2] // q.shape[-2]
    if ratio > 1:
        q, k = q.repeat_interleave(ratio, dim=-2), k.repeat_interleave(ratio, dim=-2)
    q, k, v, g, beta = (t.float() for t in (q, k, v, g, beta))
    q, k = l2norm(q), l2norm(k)
    return q * q.shape[-1] ** -0.5, k, v, g, beta


def chunked_delta_rule(
    q: torch.Tensor,  # [T, Hk, Dk]
    k: torch.Tensor,  # [T, Hk, Dk]
    v: torch.Tensor,  # [T, Hv, Dv]
    g: torch.Tensor,  # [T, Hv] log decay (<= 0)
    beta: torch.Tensor,  # [T, Hv]
    state: torch.Tensor,  # [Hv, Dk, Dv] float32
    chunk: int = CHUNK,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One sequence's T tokens from `state`: (outputs [T, Hv, Dv] in v's dtype, final state float32)."""
    dtype, length = v.dtype, q.shape[0]
    q, k, v, g, beta = _prepare(q, k, v, g, beta)
    # Heads first, the tokens padded to whole chunks: padding has k = 0 and beta = g = 0, so it neither
    # decays nor writes the state.
    pad = -length % chunk
    q, k, v = (F.pad(t.transpose(0, 1), (0, 0, 0, pad)) for t in (q, k, v))  # [H, T', D]
    g, beta = (F.pad(t.t(), (0, pad)) for t in (g, beta))  # [H, T']
    heads, n = v.shape[0], (length + pad) // chunk
    q, k, v = (t.reshape(heads, n, chunk, -1) for t in (q, k, v))
    g, beta = g.reshape(heads, n, chunk), beta.reshape(heads, n, chunk)
    cum = g.cumsum(-1)  # log decay from the chunk's start to each position
    causal = torch.ones(chunk, chunk, dtype=torch.bool, device=q.device).tril()
    # decay[i, j] = exp(cum_i - cum_j) for j <= i, else 0
    decay = (cum.unsqueeze(-1) - cum.unsqueeze(-2)).masked_fill(~causal, float("-inf")).exp()
    k_beta = k * beta.unsqueeze(-1)
    # The chunk's updates depend on each other through the state; the UT transform solves for all of
    # them at once: (I + strictly_lower(beta_i k_i.k_j decay_ij)) [u, w] = [beta v, beta k exp(cum)].
    system = (k_beta @ k.transpose(-1, -2)) * decay
    rhs = torch.cat([v * beta.unsqueeze(-1), k_beta * cum.exp().unsqueeze(-1)], dim=-1)
    solved = torch.linalg.solve_triangular(system, rhs, upper=False, unitriangular=True)
    u, w = solved.split([v.shape[-1], k.shape[-1]], dim=-1)
    scores = (q @ k.transpose(-1, -2)) * decay  # within the chunk, causal
    q_decayed = q * cum.exp().unsqueeze(-1)
    k_to_end = k * (cum[..., -1:] - cum).exp().unsqueeze(-1)
    chunk_decay = cum[..., -1].exp()  # [H, n]
    out = torch.empty_like(v)
    s = state.float()
    for i in range(n):
        fresh = u[:, i] - w[:, i] @ s  # what the state does not already recall
        out[:, i] = q_decayed[:, i] @ s + scores[:, i] @ fresh
        s = s * chunk_decay[:, i, None, None] + k_to_end[:, i].transpose(-1, -2) @ fresh
    out = out.reshape(heads, n * chunk, -1)[:, :length].transpose(0, 1)
    return out.to(dtype), s


def recurrent_delta_rule(
    q: torch.Tensor,  # [S, Hk, Dk]: one token of each of S sequences
    k: torch.Tensor,
    v: torch.Tensor,  # [S, Hv, Dv]
    g: torch.Tensor,  # [S, Hv]
    beta: torch.Tensor,  # [S, Hv]
    state: torch.Tensor,  # [S, Hv, Dk, Dv] float32
) -> tuple[torch.Tensor, torch.Tensor]:
    """One decode token per sequence: (outputs [S, Hv, Dv] in v's dtype, new states float32)."""
    dtype = v.dtype
    q, k, v, g, beta = _prepare(q, k, v, g, beta)
    s = state.float() * g.exp()[..., None, None]
    recalled = (s * k.unsqueeze(-1)).sum(-2)  # S^T k
    s = s + k.unsqueeze(-1) * ((v - recalled) * beta.unsqueeze(-1)).unsqueeze(-2)
    return (s * q.unsqueeze(-1)).sum(-2).to(dtype), s


# ---- the per-step view of the state slots ----


@dataclass
class StateStep:
    """A step's sequences as the linear-attention layers need them: each one's tokens
    [starts[i], starts[i + 1]), its state slot, and whether it starts at position 0 (a fresh state).
    slots None: no slots (a synthetic step): every sequence starts fresh and nothing is kept."""

    starts: np.ndarray  # [S + 1] int64
    fresh: torch.Tensor  # [S] bool
    slots: torch.Tensor | None  # [S] int64

    @classmethod
    def build(cls, query_lens: np.ndarray, context_lens: np.ndarray, slots: np.ndarray | None, device):
        starts = np.zeros(len(query_lens) + 1, dtype=np.int64)
        np.cumsum(query_lens, out=starts[1:])
        fresh = torch.from_numpy(np.asarray(context_lens == query_lens)).to(device)
        if slots is not None:
            slots = torch.from_numpy(np.asarray(slots, dtype=np.int64)).to(device)
        return cls(starts, fresh, slots)

    @property
    def decode_only(self) -> bool:
        return bool((np.diff(self.starts) == 1).all())

    def read(self, cache: torch.Tensor, shape, dtype) -> torch.Tensor:
        """The step's sequences' states from cache [slots, ...] (zeros where fresh), a copy."""
        n = len(self.starts) - 1
        if self.slots is None or cache is None:
            return torch.zeros(n, *shape, dtype=dtype, device=self.fresh.device)
        states = cache.index_select(0, self.slots)
        return states.masked_fill_(self.fresh.view(-1, *[1] * len(shape)), 0)

    def write(self, cache: torch.Tensor, states: torch.Tensor) -> None:
        if self.slots is not None and cache is not None:
            cache.index_copy_(0, self.slots, states.to(cache.dtype))


# ---- the layer ----


class ShortConv(nn.Module):
    """The depthwise convolution's weight [C_local, 1, K], named like the checkpoint's conv1d: this rank's
    q, k and v channels, cut from the three stretches of the full [2 key_dim + value_dim] channels."""

    def __init__(self, ranges: list[tuple[int, int]], kernel: int):
        super().__init__()
        self.ranges = ranges  # (first channel, count) in the checkpoint tensor, q then k then v
        self.weight = new_param(sum(n for _, n in ranges), 1, kernel)
        self.weight.weight_loader = self.load

    def load(self, param: nn.Parameter, source, part=None) -> None:
        shards = [source[start : start + n] for start, n in self.ranges]
        whole = torch.cat([torch.as_tensor(s) for s in shards])
        if tuple(whole.shape) != tuple(param.shape):
            raise ValueError(
                f"conv1d: checkpoint shard has shape {tuple(whole.shape)}, expected {param.shape}"
            )
        param.data.copy_(whole)


def _sliced(size: int, first: int, count: int) -> nn.Parameter:
    """A per-head parameter of which this rank holds entries [first, first + count)."""
    param = new_param(count)

    def load(p, source, part=None):
        tensor = source[first : first + count]
        if tuple(tensor.shape) != (count,):
            raise ValueError(
                f"per-head parameter: checkpoint has {source_len(source)} entries, expected {size}"
            )
        p.data.copy_(tensor)

    param.weight_loader = load
    return param


def source_len(source) -> int:
    return (source.get_shape() if hasattr(source, "get_shape") else source.shape)[0]


class GatedDeltaNet(nn.Module):
    """Qwen3-Next's linear attention: in_proj_qkvz and in_proj_ba (laid out per key head: q, k, then its
    value heads' v and z; b then a), the short convolution over q, k, v, the gated delta rule, a gated
    RMSNorm per value head, out_proj."""

    def __init__(
        self,
        hidden_size: int,
        num_k_heads: int,
        num_v_heads: int,
        k_head_dim: int,
        v_head_dim: int,
        conv_kernel: int,
        eps: float,
        tp: TensorParallel,
    ):
        super().__init__()
        if num_v_heads % num_k_heads:
            raise ValueError(
                f"linear_num_value_heads {num_v_heads} is not a multiple of "
                f"linear_num_key_heads {num_k_heads}"
            )
        self.hk = divide(num_k_heads, tp.world_size, "linear_num_key_heads")
        self.hv = self.hk * (num_v_heads // num_k_heads)
        self.dk, self.dv, self.kernel, self.eps = k_head_dim, v_head_dim, conv_kernel, eps
        self._make_projections(hidden_size, num_k_heads, num_v_heads, tp)
        key_dim, rank = num_k_heads * k_head_dim, tp.rank
        local_key, local_value = self.hk * k_head_dim, self.hv * v_head_dim
        self.conv1d = ShortConv(
            [
                (rank * local_key, local_key),
                (key_dim + rank * local_key, local_key),
                (2 * key_dim + rank * local_value, local_value),
            ],
            conv_kernel,
        )
        self.dt_bias = _sliced(num_v_heads, rank * self.hv, self.hv)
        self.A_log = _sliced(num_v_heads, rank * self.hv, self.hv)
        self.norm = nn.Module()
        self.norm.weight = new_param(v_head_dim)
        self.out_proj = RowParallelLinear(num_v_heads * v_head_dim, hidden_size, tp)

    def _make_projections(self, hidden_size: int, num_k_heads: int, num_v_heads: int, tp: TensorParallel):
        """Qwen3-Next's: one tensor laid out per key head (q, k, its value heads' v, then z), another
        per key head (b, then a); a rank's key heads are one stretch of rows in each."""
        ratio = num_v_heads // num_k_heads
        self.in_proj_qkvz = ColumnParallelLinear(
            hidden_size, num_k_heads * (2 * self.dk + 2 * ratio * self.dv), tp
        )
        self.in_proj_ba = ColumnParallelLinear(hidden_size, num_k_heads * 2 * ratio, tp)

    def _project(self, x: torch.Tensor):
        """(the convolution's input [T, q | k | v channels], z [T, Hv, Dv], b and a [T, Hv])."""
        tokens, ratio = x.shape[0], self.hv // self.hk
        qkvz = self.in_proj_qkvz(x).view(tokens, self.hk, -1)
        q, k, v, z = qkvz.split([self.dk, self.dk, ratio * self.dv, ratio * self.dv], dim=-1)
        b, a = self.in_proj_ba(x).view(tokens, self.hk, 2 * ratio).split([ratio, ratio], dim=-1)
        mixed = torch.cat([q.reshape(tokens, -1), k.reshape(tokens, -1), v.reshape(tokens, -1)], dim=-1)
        return (
            mixed,
            z.reshape(tokens, self.hv, self.dv),
            b.reshape(tokens, self.hv),
            a.reshape(tokens, self.hv),
        )

    @property
    def conv_channels(self) -> int:
        return 2 * self.hk * self.dk + self.hv * self.dv

    def state_shapes(self) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """One slot's (conv state, delta-rule state) shapes on this rank."""
        return (self.conv_channels, self.kernel - 1), (self.hv, self.dk, self.dv)

    def forward(self, x: torch.Tensor, step: StateStep, cache: tuple | None) -> torch.Tensor:
        """x [T, hidden] of the step's sequences; cache: this layer's (conv [slots, C, K-1], delta
        [slots, Hv, Dk, Dv]) or None."""
        tokens = x.shape[0]
        mixed, z, b, a = self._project(x)
        beta = b.sigmoid()
        g = -self.A_log.float().exp() * F.softplus(a.float() + self.dt_bias)
        conv_cache, delta_cache = cache if cache is not None else (None, None)
        conv_shape, delta_shape = self.state_shapes()
        conv_states = step.read(conv_cache, conv_shape, x.dtype)
        delta_states = step.read(delta_cache, delta_shape, torch.float32)
        weight = self.conv1d.weight[:, 0]
        if step.decode_only:
            mixed, conv_states = causal_conv_step(mixed, conv_states, weight)
            q, k, v = self._heads(mixed)
            out, delta_states = recurrent_delta_rule(q, k, v, g, beta, delta_states)
        else:
            outs, new_conv, new_delta = [], [], []
            for i in range(len(step.starts) - 1):
                rows = slice(int(step.starts[i]), int(step.starts[i + 1]))
                m, c = causal_conv(mixed[rows], conv_states[i], weight)
                q, k, v = self._heads(m)
                o, s = chunked_delta_rule(q, k, v, g[rows], beta[rows], delta_states[i])
                outs.append(o)
                new_conv.append(c)
                new_delta.append(s)
            out, conv_states, delta_states = torch.cat(outs), torch.stack(new_conv), torch.stack(new_delta)
        step.write(conv_cache, conv_states)
        step.write(delta_cache, delta_states)
        return self.out_proj(self._gated_norm(out, z).reshape(tokens, -1))

    def _heads(self, mixed: torch.Tensor):
        tokens, local_key = mixed.shape[0], self.hk * self.dk
        q, k, v = mixed.split([local_key, local_key, self.hv * self.dv], dim=-1)
        return (
            q.view(tokens, self.hk, self.dk),
            k.view(tokens, self.hk, self.dk),
            v.view(tokens, self.hv, self.dv),
        )

    def _gated_norm(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        """RMSNorm over each head's values (weight * normalised, in the model dtype), times silu(gate)."""
        h = x.float()
        h = self.norm.weight * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype)
        return (h * F.silu(gate.float())).to(x.dtype)


class SplitGatedDeltaNet(GatedDeltaNet):
    """Qwen3.5's: q, k and v in one tensor in the convolution's channel order (every q head, every k head,
    every v head), z, b and a each their own; each part split across ranks by heads."""

    def _make_projections(self, hidden_size: int, num_k_heads: int, num_v_heads: int, tp: TensorParallel):
        key_dim, value_dim = num_k_heads * self.dk, num_v_heads * self.dv
        self.in_proj_qkv = MergedColumnParallelLinear(hidden_size, [key_dim, key_dim, value_dim], tp)
        self.in_proj_z = ColumnParallelLinear(hidden_size, value_dim, tp)
        self.in_proj_b = ColumnParallelLinear(hidden_size, num_v_heads, tp)
        self.in_proj_a = ColumnParallelLinear(hidden_size, num_v_heads, tp)

    def _project(self, x: torch.Tensor):
        z = self.in_proj_z(x).view(x.shape[0], self.hv, self.dv)
        return self.in_proj_qkv(x), z, self.in_proj_b(x), self.in_proj_a(x)
