"""What the model runner knows of a model, and the decoder every family here is an instance of.

The runner builds `model_class(config.architecture)(config, tp)` under the target device and default
dtype (every parameter left uninitialised for the loader), and then uses only:
    num_kv_caches, kv_cache_shape(num_blocks, block_size)   to allocate the paged KV cache
    num_local_kv_heads, head_dim                            this rank's KV heads and their size
    forward(input_ids [T], positions [T], ctx, kv_caches) -> hidden [T, hidden]
    compute_logits(hidden_rows [N, hidden]) -> [N, vocab] on rank 0, None on the other ranks
and the loader reads `packed_modules_mapping`. `ctx` is the step's attention context, built once per
step by the runner and passed untouched to every attention layer.

A family is one file: its decoder layer, a CausalLM subclass naming that layer (and its norm), how its
config.json is read (`config_from_hf`, with `window_rule` and what it refuses), and how its checkpoint's
tensor names map onto merged parameters. Module names follow the Hugging Face checkpoints (`model.layers.N.
self_attn...`), so the loader maps names one to one apart from that mapping.
"""

from __future__ import annotations

import math
import mmap
from typing import ClassVar

import torch
from torch import nn

from common import kv_cache_spec
from shard_worker.model.config import NO_WINDOW, ModelConfig, common_fields
from shard_worker.model.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from shard_worker.model.layers.norm import RMSNorm
from shard_worker.model.layers.rotary import RotaryEmbedding
from shard_worker.parallel import TensorParallel

# Checkpoint projection name -> (our merged module, part index): Llama's layout, which most families share.
LLAMA_PACKED_MODULES = {
    "q_proj": ("qkv_proj", 0),
    "k_proj": ("qkv_proj", 1),
    "v_proj": ("qkv_proj", 2),
    "gate_proj": ("gate_up_proj", 0),
    "up_proj": ("gate_up_proj", 1),
}


class DecoderBody(nn.Module):
    """Named like the checkpoints' `model.` prefix."""

    def __init__(self, config: ModelConfig, tp: TensorParallel, layer_class, norm_class):
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size, tp)
        self.layers = nn.ModuleList(layer_class(config, i, tp) for i in range(config.num_layers))
        self.norm = norm_class(config.hidden_size, config.rms_norm_eps)


class CausalLM(nn.Module):
    """This rank's shard of a decoder-only model. A decoder layer is called as
    layer(hidden, (cos, sin), ctx, kv_cache) -> hidden."""

    # Checkpoint name piece -> (our parameter's module name, part of it, or None for the whole). A piece
    # left out maps to itself. Expert tensors (`experts.<e>.`) carry their expert index besides.
    packed_modules_mapping: ClassVar[dict[str, tuple[str, int | None]]] = LLAMA_PACKED_MODULES
    config_class: ClassVar[type[ModelConfig]] = ModelConfig
    window_rule: ClassVar[str] = NO_WINDOW  # see shard_worker/model/config.py
    rope_by_layer_type: ClassVar[bool] = False  # rope_parameters has one rope per layer type (Gemma 3)
    kv_block_dim: ClassVar[int] = 1  # the dim of kv_cache_shape that indexes blocks (swap copies along it)
    partial_rotary: ClassVar[bool] = False  # rotary over part of each head (Qwen3-Next)
    activations: ClassVar[tuple[str, ...]] = ("silu",)
    layer_class: ClassVar[type[nn.Module]]
    norm_class: ClassVar[type[nn.Module]] = RMSNorm

    def __init__(self, config: ModelConfig, tp: TensorParallel):
        super().__init__()
        self.config = config
        self.tp = tp
        self.model = DecoderBody(config, tp, self.layer_class, self.norm_class)
        self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size, tp)
        if config.tie_word_embeddings:
            self.lm_head.tie(self.model.embed_tokens)
        # One rotary module per distinct spec, and which one each layer applies.
        specs = list(dict.fromkeys(config.rotary))
        self.rotary = nn.ModuleList(RotaryEmbedding(spec) for spec in specs)
        self.rotary_of_layer = [specs.index(spec) for spec in config.rotary]
        attn = self.attentions()[0]
        self.num_local_kv_heads = attn.num_kv_heads
        self.head_dim = config.head_dim
        self.kv_layout = self._lay_out_kv_cache()
        # Whether the layer groups share cache tensors (a pool block one page of each): only where every
        # step brings each group's table (shard_worker/worker.py); a step with one table for every
        # layer (a test or a benchmark driving the runner) needs a tensor per layer.
        self.share_kv_tensors = False

    def attentions(self) -> list:
        """The Attention of every layer that keeps K and V (all of them but a hybrid's linear-attention
        layers), in order: the KV cache's layers."""
        return [layer.self_attn.attn for layer in self.model.layers if hasattr(layer, "self_attn")]

    @property
    def num_kv_layers(self) -> int:
        return len(self.attentions())

    @property
    def num_kv_caches(self) -> int:
        """The cache tensors a block has a page in."""
        if self.kv_layout is not None and self.share_kv_tensors:
            return self.kv_layout.layers_per_block
        return self.num_kv_layers

    def _lay_out_kv_cache(self):
        """The layer groups (common/kv_cache_spec.py) when the layers' windows differ: each Attention
        learns its group, and the cache is layers_per_block tensors shared by the groups (layer j of
        every group in tensor j); None when every layer attends to every key (a tensor a layer)."""
        attns = self.attentions()
        layout = kv_cache_spec.from_describe(
            [a.sliding_window or 0 for a in attns], 1, [getattr(a, "latent_dim", 0) for a in attns]
        )
        if layout is not None:
            for g, group in enumerate(layout.groups):
                for i in group.layers:
                    attns[i].kv_group = g
        return layout

    def layer_windows(self) -> list[int]:
        """Per KV layer: its sliding window, 0 for full attention (DescribeResponse.layer_windows)."""
        return [attn.sliding_window or 0 for attn in self.attentions()]

    def layer_latent_dims(self) -> list[int]:
        """Per layer: the values its cached latent holds a token (MLA), 0 for K and V per head
        (DescribeResponse.layer_latent_dims)."""
        return [getattr(attn, "latent_dim", 0) for attn in self.attentions()]

    @classmethod
    def config_from_hf(cls, hf, architecture: str, eos_ids: tuple[int, ...] = ()) -> ModelConfig:
        """This family's ModelConfig from transformers' parse of config.json; ValueError naming a field
        that is not served."""
        common = common_fields(
            hf, architecture, eos_ids, cls.window_rule, cls.rope_by_layer_type, cls.partial_rotary
        )
        fields = common | cls.family_fields(hf)
        if fields["hidden_act"] not in cls.activations:
            raise ValueError(
                f"hidden_act {fields['hidden_act']!r} is not supported; supported: {cls.activations}"
            )
        return cls.config_class(**fields)

    @classmethod
    def family_fields(cls, hf) -> dict:
        """Fields this family reads its own way, or adds (its ModelConfig subclass's); and its refusals."""
        return {}

    def kv_cache_shape(self, num_blocks: int, block_size: int) -> tuple[int, ...]:
        """The shape of each of the num_kv_caches caches on this rank."""
        return (2, num_blocks, block_size, self.num_local_kv_heads, self.head_dim)

    def new_kv_caches(self, num_blocks: int, block_size: int, dtype, device, host: bool = False) -> list:
        """This rank's caches: on the device, zeros (padding slots are masked out of attention, but a
        NaN left in memory there would still poison the weighted sum, 0 * NaN); in host memory (swap
        space), uninitialised, pinned when the device is CUDA (fast copies), and none for no blocks."""
        shape = self.kv_cache_shape(num_blocks, block_size)
        if host:
            if not num_blocks:
                return []
            pin = torch.device(device).type == "cuda"
            tensors = [torch.empty(shape, dtype=dtype, pin_memory=pin) for _ in range(self.num_kv_caches)]
        elif torch.device(device).type == "cpu":
            tensors = [lazy_zeros(shape, dtype) for _ in range(self.num_kv_caches)]
        else:
            tensors = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(self.num_kv_caches)]
        if self.num_kv_caches == self.num_kv_layers:
            return tensors
        # One per KV layer, the groups' layers sharing the tensors: a pool block is one page of each.
        return [tensors[self.kv_layout.tensor_of(i)] for i in range(self.num_kv_layers)]

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model.embed_tokens(input_ids)

    def forward(
        self,
        input_ids: torch.Tensor,  # [T]
        positions: torch.Tensor,  # [T]
        ctx,
        kv_caches: list[torch.Tensor],  # one per layer (layer groups share num_kv_caches tensors)
        images=None,  # shard_worker/images.py StepImages: the vision encoder's rows for placeholders
    ) -> torch.Tensor:  # [T, hidden]
        h = self.embed(input_ids)
        if images is not None:  # the placeholders' embeddings replaced by the image's soft tokens
            h = h.index_copy(0, images.rows, images.embeds.to(h.dtype))
        ropes = [rotary(positions, h.dtype) for rotary in self.rotary]
        for layer, rope, kv_cache in zip(self.model.layers, self.rotary_of_layer, kv_caches, strict=True):
            h = layer(h, ropes[rope], ctx, kv_cache)
        return self.model.norm(h)

    def compute_logits(self, hidden_rows: torch.Tensor) -> torch.Tensor | None:
        """Full-vocab logits [N, vocab] on rank 0; None on the other ranks (which must still call this,
        since it gathers)."""
        return self.lm_head(hidden_rows)


def lazy_zeros(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A zeroed host tensor on an anonymous mapping of its own, whose pages the kernel zeroes on first
    touch: torch.zeros writes every page up front (2.4 s for SmolLM2's 2 GiB CPU cache on an idle machine,
    12 s on a loaded one, all of it at start-up). Not numpy's calloc, which asks for transparent huge pages:
    faulting those in (with compaction) cost the first request 0.45 s. The tensor holds the mapping."""
    nbytes = math.prod(shape) * dtype.itemsize
    if not nbytes:
        return torch.zeros(shape, dtype=dtype)
    memory = mmap.mmap(-1, nbytes)
    return torch.frombuffer(memory, dtype=torch.uint8, count=nbytes).view(dtype).view(shape)
