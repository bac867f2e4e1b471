"""The linear-method seam: how a layer holds its weights and multiplies by them.

Every linear layer (layers/linear.py: column-, row-parallel, replicated, the LM head) and every expert
set (layers/moe.py) holds a method, chosen once per model by a QuantConfig from the layer's name:

    create_weights(layer, ...)          registers the layer's parameters (any number, any dtype), each
                                        described by `add_param` so the layer's one weight loader knows
                                        how a checkpoint tensor maps onto this rank's shard
    process_weights_after_loading(layer)  once the layer is filled: cast, quantize, repack for a kernel
    apply(layer, x, bias)               the product

A family file never sees any of this: the loader binds the methods after the model is built (it knows
each layer's name then, which an `ignore` list needs) and processes each layer as soon as the
checkpoint has filled it, so an online quantization never holds the whole model in full precision.
A wrapper method (LoRA, later) takes another method and calls its apply: apply gets the layer.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from contextvars import ContextVar

import torch
from torch import nn


class LinearMethod:
    def create_weights(
        self,
        layer: nn.Module,
        input_size_per_partition: int,
        output_partition_sizes: Sequence[int],
        params_dtype: torch.dtype,
    ) -> None:
        raise NotImplementedError

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        pass

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        raise NotImplementedError


class ExpertMethod:
    """The same three steps for a FusedMoE's stacked experts (layers/moe.py)."""

    def create_weights(
        self, layer: nn.Module, num_experts: int, hidden_size: int, local_intermediate: int, params_dtype
    ) -> None:
        raise NotImplementedError

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        pass

    def apply(self, layer: nn.Module, xs: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """Each row's expert output (before the routing weight): xs [R, H] sorted by expert, counts[e]
        rows for expert e."""
        raise NotImplementedError


class QuantConfig:
    """One per model: which method each layer gets. This base is the unquantized model; a format
    subclasses it (registered by `quant_method` name in quant/__init__.py) and answers per layer.

    unquantized: the method for layers a format leaves alone (its `ignore` list, MoE routers), which
    carries the run's --linear-dtype and prepack choices."""

    name = "none"

    def __init__(self, unquantized: LinearMethod):
        self.unquantized = unquantized

    def linear_method(self, layer: nn.Module, prefix: str, checkpoint_names: Sequence[str]) -> LinearMethod:
        """prefix: the layer's module name; checkpoint_names: the checkpoint modules it holds (q_proj,
        k_proj, v_proj for a merged qkv_proj), which is what a checkpoint's ignore list names."""
        return self.unquantized

    def expert_method(self, layer: nn.Module, prefix: str) -> ExpertMethod:
        from shard_worker.model.quant.unquantized import UnquantizedExpertMethod

        return UnquantizedExpertMethod()

    def describe(self) -> str:
        return self.name


def add_param(
    layer: nn.Module,
    name: str,
    shape: Sequence[int],
    dtype: torch.dtype,
    output_dim: int | None = None,
    input_dim: int | None = None,
    output_per: int = 1,
    input_per: int = 1,
    per_part: bool = False,
    device: torch.device | str | None = None,
) -> nn.Parameter:
    """Registers an uninitialised parameter on the layer and says how the layer's weight loader shards it:
    output_dim / input_dim: the dimension that follows the layer's output / input features (None: that
    feature axis is not in this tensor); output_per / input_per: features per entry along it (8 for eight
    4-bit values packed in an int32, group_size for group scales). per_part: one entry per merged part
    along dim 0 (a per-tensor scale of q, k and v each), never sharded."""
    param = nn.Parameter(torch.empty(*shape, dtype=dtype, device=device), requires_grad=False)
    param.output_dim, param.input_dim = output_dim, input_dim
    param.output_per, param.input_per = output_per, input_per
    param.per_part = per_part
    layer.register_parameter(name, param)
    return param


def weight_bytes(model: nn.Module) -> int:
    """Bytes of the model's weights as held: its parameters (a tied one once), the tensors of each
    layer's kernel-packed weight (`layer.packed`, quant/kernels.py), which are not parameters, and
    oneDNN's second copy where a layer holds both layouts (`layer.onednn_weight`)."""
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    for module in model.modules():
        second = getattr(module, "onednn_weight", None)  # quant/unquantized.py's both_layouts
        if second is not None:
            total += second.numel() * second.element_size()
        packed = getattr(module, "packed", None)
        if packed is not None and hasattr(packed, "nbytes"):  # kernels.PackedInt8 / PackedInt4
            total += packed.nbytes
        elif packed is not None:
            tensors = [t for t in vars(packed).values() if isinstance(t, torch.Tensor)]
            total += sum(t.numel() * t.element_size() for t in tensors)
    return total


def replace_param(layer: nn.Module, name: str, tensor: torch.Tensor) -> None:
    """After loading: the layer's parameter `name` becomes tensor (a cast or repacked copy)."""
    delattr(layer, name)
    layer.register_parameter(name, nn.Parameter(tensor, requires_grad=False))


# Whether layers built now leave their weights to load_model (which knows their names), or create plain
# ones at once (a layer built by hand, in a test). A context variable scoped to one model's construction,
# as torch.device(...) scopes where parameters go: nothing reads it during a forward.
_deferred: ContextVar[bool] = ContextVar("tpserve_deferred_weights", default=False)


@contextlib.contextmanager
def deferred_weights() -> Iterator[None]:
    token = _deferred.set(True)
    try:
        yield
    finally:
        _deferred.reset(token)


def bind_now_or_later(layer: nn.Module) -> None:
    """Called at the end of a quantizable layer's __init__."""
    if not _deferred.get():
        layer.set_method(layer.default_method())
