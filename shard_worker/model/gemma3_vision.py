"""Gemma 3's image encoder: the SigLIP vision tower and the multi-modal projector, pixels -> the soft tokens
written into an image's placeholder positions (transformers' Gemma3Model.get_image_features).

SigLIP: 14x14 (patch_size) patches embedded by a convolution, learned position embeddings, pre-norm
encoder layers (LayerNorm, full bidirectional attention with biases, gelu-tanh MLP), a last LayerNorm.
The projector: the patch grid average-pooled down to mm_tokens_per_image (256: 16 x 16), Gemma's (1 + w)
RMS norm, one matmul into the text model's width.

Replicated on every tensor-parallel rank (the simplest choice: the tower is small beside the decoder, an
image is encoded once and cached by hash, shard_worker/encoder_cache.py, and each rank then holds the
rows its own embedding step needs with no communication). No KV cache and no parallel layers, so plain
torch modules; names follow the checkpoint (`vision_tower.*`, `multi_modal_projector.*`), so loading
is a state dict read.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
import torch.nn.functional as F
from torch import nn

from shard_worker.model.layers.norm import GemmaRMSNorm

# The published checkpoints name the tower vision_tower.vision_model.*, transformers 5's save_pretrained
# vision_tower.* (its module tree: model.vision_tower.*); the projector is multi_modal_projector.* in all.
PREFIXES = ("", "model.")
PARTS = ("vision_tower.", "multi_modal_projector.")


class SiglipAttention(nn.Module):
    def __init__(self, hidden: int, heads: int):
        super().__init__()
        self.heads = heads
        self.q_proj, self.k_proj, self.v_proj, self.out_proj = (nn.Linear(hidden, hidden) for _ in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n, t, d = x.shape

        def split(proj):
            return proj(x).view(n, t, self.heads, d // self.heads).transpose(1, 2)

        o = F.scaled_dot_product_attention(split(self.q_proj), split(self.k_proj), split(self.v_proj))
        return self.out_proj(o.transpose(1, 2).reshape(n, t, d))


class SiglipMLP(nn.Module):
    def __init__(self, hidden: int, intermediate: int):
        super().__init__()
        self.fc1 = nn.Linear(hidden, intermediate)
        self.fc2 = nn.Linear(intermediate, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.gelu(self.fc1(x), approximate="tanh"))


class SiglipEncoderLayer(nn.Module):
    def __init__(self, vc):
        super().__init__()
        self.layer_norm1 = nn.LayerNorm(vc.hidden_size, eps=vc.layer_norm_eps)
        self.self_attn = SiglipAttention(vc.hidden_size, vc.num_attention_heads)
        self.layer_norm2 = nn.LayerNorm(vc.hidden_size, eps=vc.layer_norm_eps)
        self.mlp = SiglipMLP(vc.hidden_size, vc.intermediate_size)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        h = h + self.self_attn(self.layer_norm1(h))
        return h + self.mlp(self.layer_norm2(h))


class SiglipEmbeddings(nn.Module):
    def __init__(self, vc):
        super().__init__()
        self.patch_embedding = nn.Conv2d(vc.num_channels, vc.hidden_size, vc.patch_size, stride=vc.patch_size)
        self.position_embedding = nn.Embedding((vc.image_size // vc.patch_size) ** 2, vc.hidden_size)

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        patches = self.patch_embedding(pixel_values.to(self.patch_embedding.weight.dtype))
        return patches.flatten(2).transpose(1, 2) + self.position_embedding.weight


class SiglipVisionModel(nn.Module):
    def __init__(self, vc):
        super().__init__()
        self.embeddings = SiglipEmbeddings(vc)
        self.encoder = nn.Module()
        self.encoder.layers = nn.ModuleList(SiglipEncoderLayer(vc) for _ in range(vc.num_hidden_layers))
        self.post_layernorm = nn.LayerNorm(vc.hidden_size, eps=vc.layer_norm_eps)

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        h = self.embeddings(pixel_values)
        for layer in self.encoder.layers:
            h = layer(h)
        return self.post_layernorm(h)


class Gemma3MultiModalProjector(nn.Module):
    def __init__(self, vc, text_hidden: int, mm_tokens_per_image: int):
        super().__init__()
        self.mm_input_projection_weight = nn.Parameter(torch.empty(vc.hidden_size, text_hidden))
        self.mm_soft_emb_norm = GemmaRMSNorm(vc.hidden_size, vc.layer_norm_eps)
        self.patches_per_side = vc.image_size // vc.patch_size
        tokens_per_side = int(mm_tokens_per_image**0.5)
        if tokens_per_side**2 != mm_tokens_per_image or self.patches_per_side % tokens_per_side:
            raise ValueError(
                f"mm_tokens_per_image {mm_tokens_per_image} must be a square whose side divides the "
                f"{self.patches_per_side} patches of an image's side"
            )
        self.kernel = self.patches_per_side // tokens_per_side

    def forward(self, patches: torch.Tensor) -> torch.Tensor:  # [N, patches, vision hidden]
        n, _, d = patches.shape
        # Contiguous as transformers makes it: the pooled layout sets the order the float32 norm sums in.
        grid = (
            patches.transpose(1, 2).reshape(n, d, self.patches_per_side, self.patches_per_side).contiguous()
        )
        pooled = F.avg_pool2d(grid, self.kernel, self.kernel).flatten(2).transpose(1, 2)
        return (self.mm_soft_emb_norm(pooled) @ self.mm_input_projection_weight).type_as(patches)


class Gemma3ImageEncoder(nn.Module):
    """pixel_values [N, 3, image_size, image_size] -> soft tokens [N, mm_tokens_per_image, text hidden]."""

    def __init__(self, hf_config):
        super().__init__()
        vc = hf_config.vision_config
        self.vision_tower = SiglipVisionModel(vc)
        self.multi_modal_projector = Gemma3MultiModalProjector(
            vc, hf_config.text_config.hidden_size, hf_config.mm_tokens_per_image
        )
        self.requires_grad_(False)

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        return self.multi_modal_projector(self.vision_tower(pixel_values))

    def load(self, tensors: Mapping[str, torch.Tensor]) -> None:
        """Its weights from the checkpoint's tensors (name -> tensor, every name or only the encoder's);
        ValueError naming what is missing."""
        ours = {
            name[len(prefix) :].replace("vision_tower.vision_model.", "vision_tower."): t
            for name, t in tensors.items()
            for prefix in PREFIXES
            if any(name.startswith(prefix + part) for part in PARTS)
        }
        missing = sorted(set(self.state_dict()) - set(ours))
        if missing:
            raise ValueError(f"the checkpoint lacks the image encoder's {', '.join(missing[:3])}, ...")
        self.load_state_dict(ours, strict=False)
