"""--quantization int8 | fp8: an unquantized checkpoint quantized while it loads.

Each layer's full-precision weight is staged in host memory (never on the device) and quantized on the
device as soon as the loader has filled the layer (loader.load_weights processes layers one by one), so
at most one layer is ever held in full precision beside the quantized model. Linear layers only: the
LM head, the embedding, norms and MoE routers keep the model's dtype (as vLLM's online fp8 does); MoE
experts are refused (no quantized expert method yet).

int8: weight-only, symmetric per output channel (products.quantize_int8), multiplied by our CPU
linear kernel's int8 product where it runs, else the int8 kernel of quant/kernels.py (products.pack_int8).
fp8: e4m3 weights with a scale per output channel (products.quantize_fp8). On CUDA with fp8 tensor cores
(compute capability 8.9+) multiplied by torch._scaled_mm with activations quantized to e4m3 per token
(W8A8, as vLLM's --quantization fp8 does); elsewhere weight-only: our CPU linear kernel where it runs
(products.pack_fp8), else dequantized to the activations' dtype per product.
"""

from __future__ import annotations

import torch

from shard_worker.model.quant import products
from shard_worker.model.quant.base import LinearMethod, QuantConfig, add_param


class _Staged(LinearMethod):
    """A float weight in host memory until the layer is filled; then quantize(layer, w on the device)."""

    def create_weights(self, layer, input_size_per_partition, output_partition_sizes, params_dtype):
        layer.weight_device = torch.get_default_device()
        shape = (sum(output_partition_sizes), input_size_per_partition)
        add_param(layer, "weight", shape, params_dtype, output_dim=0, input_dim=1, device="cpu")

    def process_weights_after_loading(self, layer) -> None:
        w = layer.weight.detach().to(layer.weight_device)
        del layer.weight
        self.quantize(layer, w)

    def quantize(self, layer, w: torch.Tensor) -> None:
        raise NotImplementedError


class OnlineInt8Method(_Staged):
    def quantize(self, layer, w):
        products.pack_int8(layer, *products.quantize_int8(w))

    def apply(self, layer, x, bias=None):
        return products.int8_product(layer, x, bias)


class OnlineFp8Method(_Staged):
    def quantize(self, layer, w):
        q, scale = products.quantize_fp8(w, per_channel=True)
        layer.weight_fp8 = torch.nn.Parameter(q, requires_grad=False)
        layer.weight_scale = torch.nn.Parameter(scale, requires_grad=False)
        products.pack_fp8(layer, "weight_fp8")

    def apply(self, layer, x, bias=None):
        return products.fp8_product(layer, x, "weight_fp8", bias, dynamic_act=False)


class _OnlineConfig(QuantConfig):
    method_class: type[_Staged]

    def __init__(self, unquantized: LinearMethod):
        super().__init__(unquantized)
        self.method = self.method_class()

    def linear_method(self, layer, prefix, checkpoint_names):
        from shard_worker.model.layers.embedding import ParallelLMHead

        return self.unquantized if isinstance(layer, ParallelLMHead) else self.method

    def expert_method(self, layer, prefix):
        raise ValueError(f"--quantization {self.name}: MoE experts ({prefix}) cannot be quantized online yet")


class OnlineInt8Config(_OnlineConfig):
    name = "int8"
    method_class = OnlineInt8Method


class OnlineFp8Config(_OnlineConfig):
    name = "fp8"
    method_class = OnlineFp8Method
