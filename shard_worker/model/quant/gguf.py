"""GGUF files served directly (`--model x.gguf`, common/gguf_model.py): their weights read from the file,
kept quantized in a layout of ours that holds them exactly.

A layer whose parts are all 4-bit: PackedInt4 (group 32, the same q 0..15, and scale and zero that give
llama.cpp's values):
    Q4_0  w = d (q - 8)                 scale d, zero 8
    Q4_1  w = d q + m                   scale d, zero -m / d
    Q4_K  w = d sc q - dmin mn          per 32-value sub-block: scale d sc, zero dmin mn / (d sc)
          (super-blocks of 256 with 6-bit sc and mn)
A block whose scale is zero holds one value c (q does not matter): stored as q 0, zero -1, scale c.
The float zero makes Q4_1 and Q4_K equal to gguf's own dequantization up to float32 rounding (a few
ulps), Q4_0 exactly.

A layer whose parts are all symmetric: int8 in groups (our CPU kernel, else quant/int8_groups.py's
PackedInt8Groups: products.pack_int8), w = q * scale, q int8:
    Q8_0  w = d q                       group 32, q -128..127
    Q5_0  w = d (q - 16)                group 32, q - 16 in -16..15
    Q4_0  w = d (q - 8)                 group 32 (only in a merged layer with one of the others)
    Q6_K  w = d sc (q - 32)             group 16: scale d sc (int8 sc times the fp16 super-block d of
                                        256), q - 32 in -32..31
all exactly gguf's own dequantization (every product fits float32's 24 bits). A merged layer with a
Q6_K part takes group 16 throughout (the group-32 parts' scales repeated, exactly).

Dequantized once at load to the model's dtype: Q5_1, Q5_K, Q2_K, Q3_K (asymmetric, no exact layout of
ours), a merged layer mixing the two families above, and an embedding of another type or where our CPU
int8 kernel does not run (an int8-kept embedding stays int8: GGUFEmbeddingMethod; a tied LM head
multiplies by it). F32 / F16 / BF16 tensors (norms, embeddings) load as they are. Any other GGML type: a
ValueError of one line (exit 2). Every tensor of the file is read: one that maps to no parameter is an
error, as in a safetensors checkpoint.
"""

from __future__ import annotations

import functools
from collections.abc import Iterator

import numpy as np
import torch

from shard_worker.model.quant import products
from shard_worker.model.quant.base import LinearMethod, QuantConfig, add_param
from shard_worker.model.quant.kernels import PackedInt4

GROUP = 32
INT8_GROUPS = {"Q8_0": 32, "Q5_0": 32, "Q4_0": 32, "Q6_K": 16}  # kept as int8: the group of its scales


def _types():
    from gguf import GGMLQuantizationType as T

    return T


def int4_types() -> set[str]:
    return {"Q4_0", "Q4_1", "Q4_K"}


def dequantized_types() -> set[str]:
    """Read only through gguf's dequantization (the others too where no kept layout takes them)."""
    return {"Q5_1", "Q5_K", "Q2_K", "Q3_K"}


def plain_types() -> set[str]:
    return {"F32", "F16", "BF16"}


def _f16(raw: np.ndarray) -> np.ndarray:
    """Little-endian float16 from a [..., 2] uint8 array, as float32."""
    return np.ascontiguousarray(raw).view(np.float16)[..., 0].astype(np.float32)


def _constant_blocks(q, scale, zero, constant) -> None:
    """Blocks whose scale is 0 hold one value: q 0, zero -1, scale that value (in place)."""
    flat = scale == 0
    if flat.any():
        q.reshape(*scale.shape, -1)[flat] = 0
        zero[flat] = -1.0
        scale[flat] = constant[flat]


def unpack_int4(type_name: str, data: np.ndarray, shape: tuple[int, int]):
    """(q uint8 [N, K], scale float32 [N, K/32], zero float32 [N, K/32]) of a Q4_0 / Q4_1 / Q4_K tensor;
    data: its raw bytes (GGUFReader's tensor.data, [N, bytes per row])."""
    n, k = shape
    raw = np.asarray(data, dtype=np.uint8).reshape(n, -1)
    if type_name in ("Q4_0", "Q4_1"):
        head = 2 if type_name == "Q4_0" else 4
        blocks = raw.reshape(n, k // GROUP, head + 16)
        qs = blocks[..., head:]
        q = np.concatenate([qs & 15, qs >> 4], axis=-1).reshape(n, k)  # low nibbles first
        d = _f16(blocks[..., 0:2])
        if type_name == "Q4_0":
            return q, d, np.full_like(d, 8.0)
        m = _f16(blocks[..., 2:4])
        with np.errstate(divide="ignore", invalid="ignore"):
            zero = np.where(d == 0, 0.0, -m / d).astype(np.float32)
        scale = d.copy()
        _constant_blocks(q, scale, zero, m)
        return q, scale, zero
    if type_name == "Q4_K":
        blocks = raw.reshape(n, k // 256, 144)
        d, dmin = _f16(blocks[..., 0:2]), _f16(blocks[..., 2:4])
        s = blocks[..., 4:16].astype(np.uint8)
        sc = np.empty((*s.shape[:-1], 8), dtype=np.uint8)
        mn = np.empty_like(sc)
        sc[..., :4], mn[..., :4] = s[..., 0:4] & 63, s[..., 4:8] & 63
        sc[..., 4:] = (s[..., 8:12] & 15) | ((s[..., 0:4] >> 6) << 4)
        mn[..., 4:] = (s[..., 8:12] >> 4) | ((s[..., 4:8] >> 6) << 4)
        qs = blocks[..., 16:].reshape(n, k // 256, 4, 32)
        q = np.stack([qs & 15, qs >> 4], axis=3).reshape(n, k)  # chunk c: sub-blocks 2c, 2c + 1
        scale = (d[..., None] * sc).reshape(n, -1).astype(np.float32)
        offset = (dmin[..., None] * mn).reshape(n, -1).astype(np.float32)
        with np.errstate(divide="ignore", invalid="ignore"):
            zero = np.where(scale == 0, 0.0, offset / scale).astype(np.float32)
        _constant_blocks(q, scale, zero, -offset)
        return q, scale, zero
    raise ValueError(f"gguf: {type_name} is not a 4-bit type")


def unpack_int8(type_name: str, data: np.ndarray, shape: tuple[int, int]):
    """(q int8 [N, K], scale float32 [N, K / g]) of a Q8_0 / Q5_0 / Q4_0 / Q6_K tensor, w = q * scale
    (g: INT8_GROUPS[type_name]); data: its raw bytes as for unpack_int4."""
    n, k = shape
    raw = np.asarray(data, dtype=np.uint8).reshape(n, -1)
    if type_name == "Q4_0":
        q, scale, _ = unpack_int4(type_name, raw, shape)
        return (q.astype(np.int16) - 8).astype(np.int8), scale
    if type_name == "Q8_0":
        blocks = raw.reshape(n, k // 32, 34)
        return np.ascontiguousarray(blocks[..., 2:]).view(np.int8).reshape(n, k), _f16(blocks[..., 0:2])
    if type_name == "Q5_0":  # d, 32 high bits (value j's is bit j), 16 bytes of low nibbles (j, j + 16)
        blocks = raw.reshape(n, k // 32, 22)
        high = np.unpackbits(blocks[..., 2:6], axis=-1, bitorder="little")  # [.., 32], bit j of qh
        qs = blocks[..., 6:]
        low = np.concatenate([qs & 15, qs >> 4], axis=-1)
        q = (low | (high << 4)).astype(np.int16) - 16
        return q.astype(np.int8).reshape(n, k), _f16(blocks[..., 0:2])
    if type_name == "Q6_K":  # ql[128], qh[64], int8 scales[16], d: two halves of 128 values
        blocks = raw.reshape(n, k // 256, 210)
        ql = blocks[..., :128].reshape(n, -1, 2, 2, 32)  # [half, l + 32 i for i in (0, 1), l]
        qh = blocks[..., 128:192].reshape(n, -1, 2, 1, 32)
        # Value p = l + 32 j of a half (j 0..3): ql[l + 32 (j % 2)]'s low (j < 2) or high nibble, with
        # bits 2 j, 2 j + 1 of qh[l] above it.
        low = np.concatenate([ql & 15, ql >> 4], axis=3)  # j = 0, 1, 2, 3 along axis 3
        high = (qh >> (2 * np.arange(4, dtype=np.uint8))[:, None]) & 3
        q = (low | (high << 4)).astype(np.int16) - 32
        sc = np.ascontiguousarray(blocks[..., 192:208]).view(np.int8).astype(np.float32)
        d = _f16(blocks[..., 208:210])
        return q.astype(np.int8).reshape(n, k), (d[..., None] * sc).reshape(n, -1)
    raise ValueError(f"gguf: {type_name} is not kept as int8")


def check_type(name: str, type_name: str) -> None:
    if type_name not in int4_types() | set(INT8_GROUPS) | dequantized_types() | plain_types():
        raise ValueError(f"gguf: tensor {name} has type {type_name}, which is not supported")


class GGUFConfig(QuantConfig):
    """quantization_config {"quant_method": "gguf", "file": path}, written by common/gguf_model.py."""

    name = "gguf"

    def __init__(self, unquantized, file: str):
        super().__init__(unquantized)
        from gguf import GGUFReader

        self.file = file
        self.reader = GGUFReader(file)
        self.types = {t.name: t.tensor_type.name for t in self.reader.tensors}
        for tensor_name, type_name in self.types.items():
            check_type(tensor_name, type_name)
        self.names: dict[str, str] = {}  # HF checkpoint tensor name -> GGUF tensor name, set by the loader
        self.method = GGUFInt4Method()
        self.int8_methods = {g: GGUFInt8Method(g) for g in set(INT8_GROUPS.values())}

    @classmethod
    def from_config(cls, qc: dict, unquantized) -> GGUFConfig:
        return cls(unquantized, qc["file"])

    def linear_method(self, layer, prefix, checkpoint_names):
        types = {self.types.get(self.names.get(f"{name}.weight", ""), "") for name in checkpoint_names}
        if types <= int4_types():
            return self.method
        if types <= set(INT8_GROUPS):
            return self.int8_methods[min(INT8_GROUPS[t] for t in types)]
        return self.unquantized

    def expert_method(self, layer, prefix):
        raise ValueError(f"gguf: MoE experts ({prefix}) are not supported")

    def describe(self) -> str:
        counts: dict[str, int] = {}
        for type_name in self.types.values():
            counts[type_name] = counts.get(type_name, 0) + 1
        return "gguf (" + ", ".join(f"{n} {t}" for t, n in sorted(counts.items())) + ")"


class GGUFInt4Method(LinearMethod):
    """qweight uint8 [N, K / 2] (two 4-bit values a byte, the even column's low: any bits are valid, which
    --load-format dummy relies on), scales / zeros float32 [N, K / 32]: sliced by rows and groups for
    tensor parallelism like any checkpoint's, then packed once into a PackedInt4."""

    def create_weights(self, layer, input_size_per_partition, output_partition_sizes, params_dtype):
        k, n = input_size_per_partition, sum(output_partition_sizes)
        if k % GROUP:
            raise ValueError(f"gguf: {k} input features per rank are not whole blocks of {GROUP}")
        add_param(layer, "qweight", (n, k // 2), torch.uint8, output_dim=0, input_dim=1, input_per=2)
        for name in ("scales", "zeros"):
            add_param(layer, name, (n, k // GROUP), torch.float32, output_dim=0, input_dim=1, input_per=GROUP)

    def process_weights_after_loading(self, layer) -> None:
        nibbles, scale, zero = layer.qweight.detach(), layer.scales.detach(), layer.zeros.detach()
        q = torch.stack([nibbles & 15, nibbles >> 4], dim=-1).reshape(nibbles.shape[0], -1)
        layer.packed = PackedInt4.pack(q, scale, zero, GROUP)
        del layer.qweight, layer.scales, layer.zeros

    def apply(self, layer, x, bias=None):
        return products.weight_only(layer.packed, x, bias)


class GGUFInt8Method(LinearMethod):
    """qweight int8 [N, K], scales float32 [N, K / group]: sliced like GGUFInt4Method's, then held for our
    CPU kernel (products.pack_int8) or as a PackedInt8Groups."""

    def __init__(self, group: int):
        self.group = group

    def create_weights(self, layer, input_size_per_partition, output_partition_sizes, params_dtype):
        k, n, g = input_size_per_partition, sum(output_partition_sizes), self.group
        if k % g:
            raise ValueError(f"gguf: {k} input features per rank are not whole blocks of {g}")
        add_param(layer, "qweight", (n, k), torch.int8, output_dim=0, input_dim=1)
        add_param(layer, "scales", (n, k // g), torch.float32, output_dim=0, input_dim=1, input_per=g)

    def process_weights_after_loading(self, layer) -> None:
        q, scale = layer.qweight.detach(), layer.scales.detach()
        del layer.qweight, layer.scales
        products.pack_int8(layer, q, scale)  # our CPU kernel's groups, else PackedInt8Groups

    def apply(self, layer, x, bias=None):
        return products.int8_product(layer, x, bias)


class GGUFEmbeddingMethod(GGUFInt8Method):
    """An embedding table of an int8-kept type (Q8_0, Q5_0, Q4_0, Q6_K) on a CPU where our int8 kernel
    runs: q int8 [rows, H] and its group scales, each rank its vocab range (the embedding's loader), held
    in that kernel's layout (products.pack_int8); looked up by reading rows from it, and multiplied by it
    for a tied LM head (TiedInt8HeadMethod). Not expanded to --dtype: SmolLM2's 49152 x 576 table is 32 MB
    held so, 113 MB in float32 (and a tied head's bf16 copy, 57 MB, is not made)."""

    def create(self, embedding) -> None:
        rows, hidden = embedding.weight.shape
        del embedding.weight
        for name, shape, dtype in (
            ("qweight", (rows, hidden), torch.int8),
            ("scales", (rows, hidden // self.group), torch.float32),
        ):
            add_param(embedding, name, shape, dtype).weight_loader = embedding.weight_loader


class TiedInt8HeadMethod(LinearMethod):
    """A tied LM head over an embedding GGUFEmbeddingMethod holds: our int8 kernel on its layout."""

    def apply(self, layer, x, bias=None):
        return products.int8_product(layer.tied_to, x, bias)


def keep_embeddings(model, quant: GGUFConfig) -> None:
    """Before loading: each embedding whose GGUF table is of an int8-kept type stays int8 where our CPU
    kernel takes it (else it is dequantized to --dtype at load, as before), and a head tied to it
    multiplies by it."""
    from shard_worker.model.layers.embedding import ParallelLMHead, VocabParallelEmbedding
    from shard_worker.model.quant import cpu_linear

    modules = list(model.named_modules())
    for prefix, embedding in modules:
        if not isinstance(embedding, VocabParallelEmbedding):
            continue
        group = INT8_GROUPS.get(quant.types.get(quant.names.get(f"{prefix}.weight", ""), ""))
        hidden = embedding.weight.shape[1]
        cpu = embedding.weight.device.type == "cpu" and cpu_linear.available(torch.int8)
        if group is None or not cpu or hidden % group:
            continue
        embedding.quant_method = GGUFEmbeddingMethod(group)
        embedding.quant_method.create(embedding)
        for _, head in modules:
            if isinstance(head, ParallelLMHead) and head.tied_to is embedding:
                head.quant_method = TiedInt8HeadMethod()
                del head.weight


def hf_names(quant: GGUFConfig, hf_config) -> tuple[dict[str, str], object]:
    """(GGUF tensor name -> HF name, transformers' tensor processor for the architecture), from
    transformers' GGUF integration run on an empty (meta) HF model of the config."""
    from transformers import AutoModelForCausalLM
    from transformers.modeling_gguf_pytorch_utils import (
        TENSOR_PROCESSORS,
        TensorProcessor,
        get_gguf_hf_weights_map,
    )

    field = quant.reader.fields["general.architecture"]
    arch = bytes(field.parts[field.data[0]]).decode()
    processor = TENSOR_PROCESSORS.get(arch, TensorProcessor)(config=hf_config.to_dict())
    with torch.device("meta"):
        hf_model = AutoModelForCausalLM.from_config(hf_config)
    # transformers asks gguf for the (same) name table once per submodule, each built from scratch:
    # 30 s for SmolLM2's 397 modules. One table, built once, for this call.
    import gguf

    original = gguf.get_tensor_name_map
    gguf.get_tensor_name_map = functools.lru_cache(maxsize=None)(original)
    try:
        return get_gguf_hf_weights_map(hf_model, processor), processor
    finally:
        gguf.get_tensor_name_map = original


def gguf_tensors(
    quant: GGUFConfig, mapping: dict, processor, dtype, kept: dict[str, LinearMethod]
) -> Iterator[tuple[str, torch.Tensor]]:
    """(HF checkpoint name, tensor) for every tensor of the file: a layer kept quantized as its
    <module>.qweight / .scales (/ .zeros for 4-bit), anything else dequantized to dtype. Rows are
    reordered as transformers' processor does (Llama's q / k un-permutation), applied to q and scales
    alike. kept: the HF modules (q_proj, ...) whose layer took a GGUF method, and that method."""
    from gguf.quants import dequantize

    for tensor in quant.reader.tensors:
        type_name = tensor.tensor_type.name
        shape = tuple(int(x) for x in reversed(tensor.shape.tolist()))
        if type_name in int4_types() | set(INT8_GROUPS) and len(shape) == 2:
            n, _ = shape
            index = processor.process(weights=np.arange(n, dtype=np.float64)[:, None], name=tensor.name)
            if index.name not in mapping:
                raise ValueError(f"gguf: tensor {tensor.name} maps to no parameter of the model")
            module = mapping[index.name].removesuffix(".weight")
            method = kept.get(module)
            if method is not None:
                rows = index.weights[:, 0].astype(np.int64)
                if not np.array_equal(np.sort(rows), np.arange(n)):
                    raise ValueError(f"gguf: {tensor.name}: a kept tensor that needs more than a row reorder")
                yield from _kept_tensors(module, method, type_name, tensor.data, shape, rows)
                continue
        weights = dequantize(tensor.data, tensor.tensor_type)
        result = processor.process(weights=weights, name=tensor.name)
        if result.name not in mapping:
            raise ValueError(f"gguf: tensor {tensor.name} maps to no parameter of the model")
        yield mapping[result.name], torch.from_numpy(np.array(result.weights)).to(dtype)


def _kept_tensors(module: str, method, type_name: str, data, shape, rows):
    if isinstance(method, GGUFInt4Method):
        q, scale, zero = unpack_int4(type_name, data, shape)
        q = q[rows]
        yield f"{module}.qweight", torch.from_numpy(q[:, 0::2] | (q[:, 1::2] << 4))
        yield f"{module}.scales", torch.from_numpy(scale[rows])
        yield f"{module}.zeros", torch.from_numpy(zero[rows])
        return
    q, scale = unpack_int8(type_name, data, shape)
    scale = scale[rows].repeat(INT8_GROUPS[type_name] // method.group, axis=1)  # a Q6_K part's 16
    yield f"{module}.qweight", torch.from_numpy(q[rows])
    yield f"{module}.scales", torch.from_numpy(np.ascontiguousarray(scale))
