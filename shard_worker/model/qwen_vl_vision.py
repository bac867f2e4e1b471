"""The Qwen2.5-VL and Qwen3-VL vision towers: an image's patches -> the embeddings written into its
placeholder positions (transformers' Qwen2_5_VisionTransformerPretrainedModel, Qwen3VLVisionModel).

Both take the processor's output as it is: pixel_values [patches, C * temporal_patch * patch * patch],
each image's patches in the processor's order (per temporal slice, 2x2 merge blocks row-major, the four
patches of a block together), with grid_thw (t, h, w) per image in patches. Both embed a patch with one
matmul (a Conv3d whose kernel is the patch), rotate q and k in each head by the patch's (row, column)
(a 2D rope: the first half of the frequencies by the row, the second by the column), attend within
each image (each temporal slice) and merge each 2x2 block of patches into one token of the text model's
width. Qwen2.5-VL: RMS norms, a gated SiLU MLP, window attention (window_size pixels square, in merge
blocks) in all layers but fullatt_block_indexes, the patches reordered window by window for that (and
back after the merger). Qwen3-VL: LayerNorms, a plain GELU MLP, learned position embeddings
bilinearly resampled to each image's grid, full attention everywhere, and deepstack: the hidden states
after the layers in deepstack_visual_indexes each merged by a merger of their own, added to the text
model's hidden states at the image's placeholders after its first layers (shard_worker/model/qwen3_vl.py).

Replicated on every tensor-parallel rank like Gemma 3's (shard_worker/model/gemma3_vision.py says why);
plain torch modules named as the checkpoints name them (`visual.*`, `model.visual.*` in transformers 5),
loaded by a state dict read.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
import torch.nn.functional as F
from torch import nn
from transformers.activations import ACT2FN

from shard_worker.model.layers.norm import RMSNorm

# Older checkpoints name the tower visual.*, transformers 5's save_pretrained model.visual.*.
PREFIXES = ("model.visual.", "visual.")


def patch_positions(grid_thw: list[tuple[int, int, int]], merge: int) -> torch.Tensor:
    """[patches, 2] (row, column) of each patch in the processor's order (merge blocks row-major)."""
    rows = []
    for t, h, w in grid_thw:
        hh, ww = torch.meshgrid(torch.arange(h), torch.arange(w), indexing="ij")
        shape = (h // merge, merge, w // merge, merge)
        block = torch.stack(
            [hh.reshape(shape).transpose(1, 2).flatten(), ww.reshape(shape).transpose(1, 2).flatten()], dim=-1
        )
        rows.append(block.repeat(t, 1))
    return torch.cat(rows)


def image_segments(grid_thw: list[tuple[int, int, int]]) -> list[int]:
    """The lengths (in patches) of the spans that attend to one another: each image's temporal slices."""
    return [h * w for t, h, w in grid_thw for _ in range(t)]


def window_order(
    grid_thw: list[tuple[int, int, int]], merge: int, window: int
) -> tuple[torch.Tensor, list[int]]:
    """Qwen2.5-VL's windows: (the merge blocks reordered window by window, windows row-major over each
    slice and blocks row-major within a window; the windows' lengths in patches). `window` is in merge
    blocks a side; edge windows are smaller."""
    order, lengths, base = [], [], 0
    for t, h, w in grid_thw:
        gh, gw = h // merge, w // merge
        index = torch.arange(t * gh * gw).reshape(t, gh, gw)
        for s in range(t):
            for r in range(0, gh, window):
                for c in range(0, gw, window):
                    cell = index[s, r : r + window, c : c + window].flatten()
                    order.append(cell + base)
                    lengths.append(len(cell) * merge * merge)
        base += t * gh * gw
    return torch.cat(order), lengths


class VisionRotary(nn.Module):
    """The tower's 2D rope: head_dim / 4 frequencies, applied to the row and then to the column."""

    def __init__(self, head_dim: int, theta: float):
        super().__init__()
        half = head_dim // 2
        inv_freq = 1.0 / (theta ** (torch.arange(0, half, 2, dtype=torch.float) / half))
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def forward(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """[patches, 1, head_dim] cos and sin in float32 (the tower rotates in float32)."""
        # float32 as transformers computes them (.double() on the tower casts the buffer, not the angles).
        freqs = (positions.float().unsqueeze(-1) * self.inv_freq.float()).flatten(1)  # [N, head_dim / 2]
        emb = torch.cat([freqs, freqs], dim=-1).unsqueeze(1)
        return emb.cos(), emb.sin()


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    xf = x.float()
    rotated = torch.cat([-xf[..., half:], xf[..., :half]], dim=-1)
    return (xf * cos + rotated * sin).to(x.dtype)


class VisionAttention(nn.Module):
    """Bidirectional attention within each segment (an image slice, or a window of one)."""

    def __init__(self, hidden: int, heads: int):
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(hidden, hidden * 3)
        self.proj = nn.Linear(hidden, hidden)

    def forward(self, x: torch.Tensor, rope, segments: list[int]) -> torch.Tensor:
        n = x.shape[0]
        q, k, v = self.qkv(x).view(n, 3, self.heads, -1).unbind(1)
        q, k = _rotate(q, *rope), _rotate(k, *rope)
        out = torch.empty_like(q)
        # Segments of one length attend in one batched call (an image's windows are mostly full ones).
        for rows in _rows_by_length(segments, x.device):  # [segments of this length, length]
            o = F.scaled_dot_product_attention(*(t[rows].transpose(1, 2) for t in (q, k, v)))
            out[rows] = o.transpose(1, 2)
        return self.proj(out.reshape(n, -1))


def _rows_by_length(segments: list[int], device) -> list[torch.Tensor]:
    """The rows of each segment, grouped by segment length: one [count, length] index a length."""
    starts: dict[int, list[int]] = {}
    offset = 0
    for length in segments:
        starts.setdefault(length, []).append(offset)
        offset += length
    return [
        (torch.tensor(firsts)[:, None] + torch.arange(length)).to(device) for length, firsts in starts.items()
    ]


class GatedVisionMLP(nn.Module):
    """Qwen2.5-VL's: down(act(gate(x)) * up(x)), with biases."""

    def __init__(self, hidden: int, intermediate: int, act: str):
        super().__init__()
        self.gate_proj = nn.Linear(hidden, intermediate)
        self.up_proj = nn.Linear(hidden, intermediate)
        self.down_proj = nn.Linear(intermediate, hidden)
        self.act = ACT2FN[act]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_proj(x)) * self.up_proj(x))


class PlainVisionMLP(nn.Module):
    """Qwen3-VL's: fc2(act(fc1(x)))."""

    def __init__(self, hidden: int, intermediate: int, act: str):
        super().__init__()
        self.linear_fc1 = nn.Linear(hidden, intermediate)
        self.linear_fc2 = nn.Linear(intermediate, hidden)
        self.act = ACT2FN[act]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_fc2(self.act(self.linear_fc1(x)))


class VisionBlock(nn.Module):
    def __init__(self, vc, norm, mlp_class):
        super().__init__()
        self.norm1 = norm(vc.hidden_size)
        self.norm2 = norm(vc.hidden_size)
        self.attn = VisionAttention(vc.hidden_size, vc.num_heads)
        self.mlp = mlp_class(vc.hidden_size, vc.intermediate_size, vc.hidden_act)

    def forward(self, h: torch.Tensor, rope, segments: list[int]) -> torch.Tensor:
        h = h + self.attn(self.norm1(h), rope, segments)
        return h + self.mlp(self.norm2(h))


class PatchEmbed(nn.Module):
    """A Conv3d whose kernel is the whole patch: one matmul over the flattened patch."""

    def __init__(self, vc, bias: bool):
        super().__init__()
        kernel = (vc.temporal_patch_size, vc.patch_size, vc.patch_size)
        self.proj = nn.Conv3d(vc.in_channels, vc.hidden_size, kernel, stride=kernel, bias=bias)

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        weight = self.proj.weight
        return F.linear(pixels.to(weight.dtype), weight.flatten(1), self.proj.bias)


def _rms_norm(size: int) -> RMSNorm:
    norm = RMSNorm(size, 1e-6)
    norm.weight.requires_grad_(False)
    return norm


def _layer_norm(size: int) -> nn.LayerNorm:
    return nn.LayerNorm(size, eps=1e-6)


class Qwen2_5_VLMerger(nn.Module):
    def __init__(self, vc):
        super().__init__()
        self.size = vc.hidden_size * vc.spatial_merge_size**2
        self.ln_q = _rms_norm(vc.hidden_size)
        self.mlp = nn.Sequential(
            nn.Linear(self.size, self.size), nn.GELU(), nn.Linear(self.size, vc.out_hidden_size)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.mlp(self.ln_q(x).view(-1, self.size))


class Qwen3VLMerger(nn.Module):
    """The norm over each patch (the last merger), or over the merged block (deepstack's)."""

    def __init__(self, vc, postshuffle: bool):
        super().__init__()
        self.size = vc.hidden_size * vc.spatial_merge_size**2
        self.postshuffle = postshuffle
        self.norm = _layer_norm(self.size if postshuffle else vc.hidden_size)
        self.linear_fc1 = nn.Linear(self.size, self.size)
        self.linear_fc2 = nn.Linear(self.size, vc.out_hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.norm(x.view(-1, self.size)) if self.postshuffle else self.norm(x).view(-1, self.size)
        return self.linear_fc2(F.gelu(self.linear_fc1(x)))


def _axis_taps(n: int, side: int) -> tuple[torch.Tensor, torch.Tensor]:
    """[n, 2] source indices and float32 weights resampling `side` table entries to n, corners aligned."""
    src = torch.arange(n, dtype=torch.float32) * (side - 1) / max(n - 1, 1)
    floor = src.floor()
    offsets = torch.arange(2)
    taps = (floor.long()[:, None] + offsets).clamp(0, side - 1)
    # 1 - |distance| for both taps, rounded as transformers rounds it (not frac and 1 - frac).
    return taps, (1 - (src[:, None] - floor[:, None] - offsets).abs()).clamp(min=0)


class QwenVisionTower(nn.Module):
    """What both towers share: load, and the checks on their input."""

    def load(self, tensors: Mapping[str, torch.Tensor]) -> None:
        """Its weights from the checkpoint's tensors (name -> tensor, every name or only the tower's);
        ValueError naming what is missing."""
        ours = {
            name[len(prefix) :]: t
            for name, t in tensors.items()
            for prefix in PREFIXES
            if name.startswith(prefix)
        }
        missing = sorted(set(self.state_dict()) - set(ours))
        if missing:
            raise ValueError(
                f"the checkpoint lacks the vision tower's visual.{', visual.'.join(missing[:3])}, ..."
            )
        self.load_state_dict(ours, strict=False)

    def num_tokens(self, grid_thw) -> list[int]:
        """Each image's placeholders: its patches over merge**2."""
        return [t * h * w // self.merge**2 for t, h, w in grid_thw]

    def _check(self, pixels: torch.Tensor, grid_thw) -> list[tuple[int, int, int]]:
        grid = [tuple(int(x) for x in g) for g in grid_thw]
        if sum(t * h * w for t, h, w in grid) != pixels.shape[0]:
            raise ValueError(f"{pixels.shape[0]} patches for images of grids {grid}")
        if any(h % self.merge or w % self.merge for _, h, w in grid):
            raise ValueError(f"an image's grid {grid} is not in whole {self.merge}x{self.merge} merge blocks")
        return grid


class Qwen2_5_VisionTransformer(QwenVisionTower):
    """pixel_values [patches, C*T*P*P], grid_thw -> [tokens, out_hidden_size] (images in order)."""

    def __init__(self, vc):
        super().__init__()
        self.merge = vc.spatial_merge_size
        self.window = vc.window_size // vc.spatial_merge_size // vc.patch_size
        self.full_layers = set(vc.fullatt_block_indexes)
        self.patch_embed = PatchEmbed(vc, bias=False)
        head_dim = vc.hidden_size // vc.num_heads
        self.rotary = VisionRotary(head_dim, vc.rope_parameters["rope_theta"])
        self.blocks = nn.ModuleList(VisionBlock(vc, _rms_norm, GatedVisionMLP) for _ in range(vc.depth))
        self.merger = Qwen2_5_VLMerger(vc)
        self.requires_grad_(False)

    def forward(self, pixels: torch.Tensor, grid_thw) -> torch.Tensor:
        grid = self._check(pixels, grid_thw)
        unit = self.merge**2
        order, windows = window_order(grid, self.merge, self.window)

        def by_window(x: torch.Tensor) -> torch.Tensor:  # patches reordered window by window
            return x.reshape(-1, unit, *x.shape[1:])[order].reshape(x.shape)

        h = by_window(self.patch_embed(pixels))
        cos, sin = self.rotary(patch_positions(grid, self.merge))
        rope = (by_window(cos), by_window(sin))
        images = image_segments(grid)
        for i, block in enumerate(self.blocks):
            h = block(h, rope, images if i in self.full_layers else windows)
        return self.merger(h)[torch.argsort(order)]


class Qwen3VLVisionModel(QwenVisionTower):
    """pixel_values, grid_thw -> ([tokens, out_hidden_size], [deepstack features, one per
    deepstack_visual_indexes entry, each [tokens, out_hidden_size]])."""

    def __init__(self, vc):
        super().__init__()
        self.merge = vc.spatial_merge_size
        self.patch_embed = PatchEmbed(vc, bias=True)
        self.pos_embed = nn.Embedding(vc.num_position_embeddings, vc.hidden_size)
        self.side = int(vc.num_position_embeddings**0.5)
        head_dim = vc.hidden_size // vc.num_heads
        self.rotary = VisionRotary(head_dim, vc.rope_parameters["rope_theta"])
        self.blocks = nn.ModuleList(VisionBlock(vc, _layer_norm, PlainVisionMLP) for _ in range(vc.depth))
        self.merger = Qwen3VLMerger(vc, postshuffle=False)
        self.deepstack_layers = list(vc.deepstack_visual_indexes)
        self.deepstack_merger_list = nn.ModuleList(
            Qwen3VLMerger(vc, postshuffle=True) for _ in self.deepstack_layers
        )
        self.requires_grad_(False)

    def position_embeddings(self, grid: list[tuple[int, int, int]]) -> torch.Tensor:
        """The learned side x side table resampled (bilinear, corners aligned) to each image's grid, in
        the patches' order: the four taps' weights in float32, their sum in the model's dtype (as
        transformers' get_vision_interpolation_indices_and_weights has it)."""
        m, table = self.merge, self.pos_embed.weight
        rows = []
        for t, h, w in grid:
            (h_taps, h_weights), (w_taps, w_weights) = (_axis_taps(n, self.side) for n in (h, w))
            taps = (h_taps[:, None, :, None] * self.side + w_taps[None, :, None, :]).reshape(h, w, 4)
            weights = (h_weights[:, None, :, None] * w_weights[None, :, None, :]).reshape(h, w, 4)
            # Row-major patches -> merge-block order.
            taps, weights = (
                x.reshape(h // m, m, w // m, m, 4).transpose(1, 2).reshape(h * w, 4) for x in (taps, weights)
            )
            grid_embeds = (table[taps] * weights.unsqueeze(-1).to(table.dtype)).sum(1)
            rows.append(grid_embeds.repeat(t, 1))
        return torch.cat(rows)

    def forward(self, pixels: torch.Tensor, grid_thw) -> tuple[torch.Tensor, list[torch.Tensor]]:
        grid = self._check(pixels, grid_thw)
        h = self.patch_embed(pixels) + self.position_embeddings(grid)
        rope = self.rotary(patch_positions(grid, self.merge))
        images = image_segments(grid)
        deepstack = []
        for i, block in enumerate(self.blocks):
            h = block(h, rope, images)
            if i in self.deepstack_layers:
                deepstack.append(self.deepstack_merger_list[self.deepstack_layers.index(i)](h))
        return self.merger(h), deepstack
