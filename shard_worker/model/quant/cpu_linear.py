"""A CPU linear kernel of our own (csrc/cpu_linear.cpp) for the unquantized float32 and bfloat16 weights,
and int8 weight-only ones with a float32 scale per output row (csrc/cpu_linear_int8.cpp): the weight
repacked once into row blocks streamed sequentially, a pass over it per call whatever the number of input
rows up to 8 (register-blocked chunks above), float32 sums.

Why: a decode step is ~78% linear products, and at small batch they are bound by how fast the weights
stream from memory. One thread, AMD EPYC Zen 4 (AVX-512 BF16, no AMX), shared machine, 2026-12-03:
  bench/cpu_linear.py, SmolLM2's 211 products (bf16 269 MB), kernel against oneDNN's prepacked product,
      rows     1      8     16     32    128    512
      bf16   1.60x  1.44x  1.11x  1.07x  0.98x  1.00x   (1 row: 17.6 GB/s against 11.0)
      fp32   1.75x  1.43x     -   1.03x     -   0.99x
      AVX2   1.59x  1.49x     -   1.07x     -   1.00x   (fp32, -mno-avx512f, ONEDNN_MAX_CPU_ISA=AVX2)
  A whole decode step (bench/decode_profile.py, bf16 model, batch 1, one model per process): 33-34 ms
      against oneDNN's 38-49 ms. Both models in one process (--variants X:cpu X:cpu:onednn) gave 1.6-1.8x,
      oneDNN's step slower there than alone: trust separate runs. The whole stack at concurrency 1 and 8 (our
      client, 4-12 requests a row, three rounds alternating) showed no difference beyond this shared
      machine's run-to-run spread (TPOT p50 33-41 ms either way). A 512-token prefill: 0.9-1.1x.
  int8 weights (bench/cpu_linear.py --int8, SmolLM2's products, 135 MB of int8, bf16 x, the thread's CPU
      time, ratios within one run; the int8 rows' spread over three runs in brackets):
      rows                                1      8     32
      int8 per row (--quantization int8, W8A16), ms
                                       10.1   14.7   47.9
        against our bf16 kernel        1.66x  1.37x  1.09x   (1.44-1.71x, 1.23-1.37x, 1.07-1.09x)
        against _weight_int8pack_mm    2.18x  3.34x  3.48x   (what ran before)
        against our float32 kernel     2.69x  2.10x  2.09x
      groups of 32 k (GGUF Q8_0), against our bf16 kernel
                                       1.50x  1.18x  0.90x   (1.22-1.50x, 1.02-1.18x, 0.87-0.90x)
        against PackedInt8Groups       1.73x  3.41x  4.23x
      W8A8 (VNNI), against our bf16    1.81x  1.27x  1.56x
        against fbgemm's dynamic       1.54x  1.70x  2.00x
      As an AVX2-only CPU would run them (--variant avx2, ATEN_CPU_CAPABILITY=avx2): int8 2.0-2.2x
      _weight_int8pack_mm, Q8_0 2.6-3.4x PackedInt8Groups; without AVX-512 BF16 (--variant avx512):
      int8 1.7-2.3x. At 1 row int8 streams at 12-14 GB/s, short of bf16's 16-19 GB/s here (~9 us of
      Python and ctypes a call, 2 ms of the 211 calls, weigh more on the shorter pass).
  A whole decode step (bench/decode_profile.py --quant, one thread, one run, LM head in bf16): batch 1
      float32 36.7 ms, bf16 23.2, int8 20.1 (1.83x float32's tokens/s, 1.15x bf16's); batch 8: 58.1,
      52.0, 46.0; batch 32: 166.8, 111.4, 104.5. Teacher-forced NLL on README.md: int8 +0.11%.
      SmolLM2 written as a Q8_0 GGUF (bfloat16:cpu against bfloat16:cpu:onednn, which also holds the
      other layers for oneDNN): 18.0 / 23.7 ms at batch 1, 34.6 / 63.0 at 8, 86.4 / 243.4 at 32.

  4-bit weights (--int8's int4 column, group 64 on SmolLM2, 128 on Llama-3-8B's layer; quiet machine):
      1.13x / 0.85x / 0.83x the int8 kernel at 1 / 8 / 32 rows on SmolLM2 (per-call costs weigh on its
      small layers), 1.60x / 0.83x / 0.85x on a Llama-3-8B layer, 1.2-2.1x tinygemm; fp8 1.16x / 0.96x
      / 0.73x our bf16 kernel. docs/quantization.md has the whole table.

`PackedLinear.pack(weight)` holds the layout (e4m3 as int8 bytes; pack_int4 the 4-bit one; weight dtype
float32 or bfloat16: bfloat16 16-row blocks with k in pairs, float32 16-row blocks with AVX-512F, 8-row ones
with AVX2; int8 with `scale=`: 16-row blocks, a step the 16 rows at k then at k + 1); `linear(x, packed,
bias)` multiplies x [..., K] in float32 or bfloat16 (x is rounded to bfloat16 for a bfloat16 weight, as
unquantized.linear rounds it, and for an int8 one where the CPU has AVX-512 BF16: `int8_rounds_x()`) and
returns y in x's dtype. `available(dtype)`: whether this machine builds the kernel with vector instructions
for that weight dtype (else the caller keeps oneDNN, or _weight_int8pack_mm for int8; the library's plain-loop
paths then serve only tests)."""

from __future__ import annotations

import ctypes
import functools
import math
from pathlib import Path

import torch
import torch.nn.functional as F

from shard_worker import cpu_ext

_CSRC = Path(__file__).with_name("csrc")
EXT = cpu_ext.Extension(
    "cpu_linear",
    _CSRC / "cpu_linear.cpp",
    "tp_linear_abi",
    7,
    "the CPU linear kernel",
    more=(
        _CSRC / "cpu_linear_int8.cpp",
        _CSRC / "cpu_linear_int4.cpp",
        _CSRC / "cpu_linear.h",
        _CSRC / "cpu_linear_tiles.h",
    ),
)
CODES = {torch.float32: 0, torch.bfloat16: 1, torch.int8: 2, torch.float8_e4m3fn: 5}
X_CODES = {torch.float32: 0, torch.bfloat16: 1}  # what x, y and a bias may be
W8A8 = 3  # the code of an int8 weight whose products quantize x per row (PackedLinear.pack_w8a8)
INT4 = 4  # a 4-bit weight with a scale and offset per group (PackedLinear.pack_int4)
FP8 = 5  # e4m3 weights with a scale per row, in the int8 layout (PackedLinear.pack with an fp8 weight)
# The flag set (cpu_ext.VARIANTS) layers are packed for: "native" except to measure another CPU's path
# here (bench: "avx2", as an AVX2-only machine would run).
VARIANT = "native"


@functools.cache
def library(variant: str = "native") -> ctypes.CDLL:
    lib = EXT.load(variant)
    i, i64, ptr = ctypes.c_int, ctypes.c_int64, ctypes.c_void_p
    lib.tp_linear.argtypes = [i, i, ptr, ptr, ptr, ptr, i64, i, ptr, i64, i64, i64, i]
    lib.tp_linear.restype = i
    return lib


def available(weight_dtype: torch.dtype) -> bool:
    """Whether this CPU runs the kernel with vector instructions for weights of this dtype."""
    if weight_dtype not in CODES or EXT.unavailable(VARIANT) is not None:
        return False
    return bool(library(VARIANT).tp_linear_native(CODES[weight_dtype]))


# From this many rows, a bfloat16 product on a CPU with AMX goes to oneDNN, whose AMX tile products our
# kernel (vector instructions only) does not match there: the weight is unpacked for it, one [N, K] copy
# a call, which a prompt's rows repay. Two threads, Xeon with AMX, SmolLM2's and all-MiniLM's shapes (ms,
# ours / oneDNN with the unpack): 64 rows 0.32-0.71 / 0.32-0.73 (even), 128 rows 0.63-1.82 / 0.35-0.81,
# 512 rows 2.7-5.7 / 0.58-1.25, 2048 rows 11-25 / 1.4-2.9. Fewer rows stay here: at 1-4 rows ours is
# 1.2-2.5x oneDNN's prepacked product, at 8-32 rows oneDNN's wins (1.4-4x) but not with the unpack.
AMX_ONEDNN_ROWS = 128


@functools.cache
def amx_bf16() -> bool:
    """Whether oneDNN multiplies bfloat16 with AMX tiles on this CPU."""
    from shard_worker.devices import cpu_flags

    onednn = torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported()
    return onednn and "amx_bf16" in cpu_flags()


def available_w8a8() -> bool:
    """Whether this CPU runs W8A8 products with vector instructions (AVX-512 VNNI)."""
    return EXT.unavailable(VARIANT) is None and bool(library(VARIANT).tp_linear_native(W8A8))


def available_int4() -> bool:
    """Whether this CPU runs 4-bit products with vector instructions (AVX-512, or AVX2 + FMA)."""
    return EXT.unavailable(VARIANT) is None and bool(library(VARIANT).tp_linear_native(INT4))


def int4_group(group_size: int, in_features: int) -> int:
    """The group the int4 kernel runs a weight with groups of group_size k in (or per channel: group_size
    = in_features) at: the largest multiple of 8 dividing group_size and 2048 (its scales repeated over
    the smaller groups, exactly); 0 where there is none or K is off it."""
    g = math.gcd(group_size, 2048)
    return g if g % 8 == 0 and in_features % g == 0 else 0


def int8_rounds_x(variant: str | None = None) -> bool:
    """Whether an int8 weight's product rounds x to bfloat16 (AVX-512 BF16: _mm512_dpbf16_ps), else it
    multiplies x in float32."""
    return bool(library(variant or VARIANT).tp_linear_int8_bf16_x())


class PackedLinear:
    """A [N, K] weight in the kernel's layout: `data` [N / R, K2 / 2, R, 2] (bfloat16), [N / R, K, R]
    (float32) or [N / 16, K2 / 2, 2, 16] (int8), zero rows and a zero column padding N and K. An int8
    weight's `scale`: float32 [N] (w = q * scale per row), or with `group` g, [N / 16, K / g, 16] (a scale
    per row and group of g k). The layer's `weight` parameter holds `data` (so weight_bytes counts it
    once)."""

    def __init__(
        self, data, out_features: int, in_features: int, variant: str, scale=None, group: int = 0, code=None
    ):
        self.data, self.variant, self.scale, self.group = data, variant, scale, group
        self.out_features, self.in_features = out_features, in_features
        # What each call passes, looked up once (a decode step makes a few hundred calls).
        self.code = CODES[data.dtype] if code is None else code
        self.fn, self.ptr = library(variant).tp_linear, data.data_ptr()
        self.scale_ptr = None if scale is None else scale.data_ptr()

    @property
    def dtype(self) -> torch.dtype:
        return self.data.dtype

    @classmethod
    def pack(cls, weight: torch.Tensor, variant: str | None = None, scale=None) -> PackedLinear:
        """weight float32 or bfloat16 [N, K]; or int8 with its scale per row (float32 [N]) or per row and
        group of g k ([N, K / g]: g even, dividing K and 2048); or e4m3 (float8_e4m3fn) with its scale per
        row (held as int8 bytes in the int8 layout, `code` FP8)."""
        variant = variant or VARIANT
        n, k = weight.shape
        fp8 = weight.dtype == torch.float8_e4m3fn
        if fp8 and (scale is None or scale.dim() != 1):
            raise ValueError("an e4m3 weight takes a scale per row")
        if fp8:  # the int8 layout, the bytes as they are
            packed = cls.pack(weight.view(torch.int8), variant, scale)
            packed.code = FP8
            return packed
        if (weight.dtype == torch.int8) != (scale is not None) or weight.dtype not in CODES:
            raise ValueError(f"a {weight.dtype} weight with{'' if scale is None else ' a'} scale")
        rows = library(variant).tp_linear_rows(CODES[weight.dtype])
        blocks = -(-n // rows)
        w = weight.detach()
        if weight.dtype == torch.float32:
            w = F.pad(w, (0, 0, 0, blocks * rows - n))
            data = w.reshape(blocks, rows, k).permute(0, 2, 1).contiguous()
        else:
            k2 = k + k % 2
            w = F.pad(w, (0, k2 - k, 0, blocks * rows - n)).reshape(blocks, rows, k2 // 2, 2)
            # bfloat16: a step is 16 rows' (k, k + 1) pairs; int8: 16 rows' k, then their k + 1.
            data = w.permute(0, 2, 1, 3) if weight.dtype == torch.bfloat16 else w.permute(0, 2, 3, 1)
            data = data.contiguous()
        group = 0
        if scale is not None and scale.dim() == 2:
            group = k // max(scale.shape[1], 1)
            if tuple(scale.shape) != (n, k // group) or group % 2 or 2048 % group:
                raise ValueError(
                    f"group scales {tuple(scale.shape)} for [{n}, {k}]: groups of an even k dividing 2048"
                )
            s = F.pad(scale.detach().to(torch.float32), (0, 0, 0, blocks * rows - n))
            scale = s.reshape(blocks, rows, k // group).permute(0, 2, 1).contiguous()
        elif scale is not None:
            scale = scale.detach().to(torch.float32).reshape(n).contiguous()
        return cls(data, n, k, variant, scale, group)

    @classmethod
    def pack_w8a8(cls, q: torch.Tensor, scale: torch.Tensor, variant: str | None = None) -> PackedLinear:
        """int8 q [N, K] with a scale per row, multiplied W8A8: each row of x quantized to int8 by its own
        absmax (kernels.PackedInt8.matmul_dynamic's rule), exact int32 sums. `data` [N / 16, K4 / 4, 16, 4]
        (K4: K rounded up to a multiple of 4), `scale` [2, N]: the scales, then each row's sum of q."""
        n, k = q.shape
        blocks, k4 = -(-n // 16), -(-k // 4) * 4
        w = F.pad(q.detach(), (0, k4 - k, 0, blocks * 16 - n)).reshape(blocks, 16, k4 // 4, 4)
        sums = q.detach().sum(1, dtype=torch.int32).float()
        scales = torch.stack([scale.detach().to(torch.float32).reshape(n), sums]).contiguous()
        packed = cls(w.permute(0, 2, 1, 3).contiguous(), n, k, variant or VARIANT, scales)
        packed.code = W8A8
        return packed

    @classmethod
    def pack_int4(
        cls, q: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor, variant: str | None = None
    ) -> PackedLinear:
        """4-bit q (uint8 [N, K], values 0..15) with w = q * scale + offset per row and group of g k
        (scale, offset float32 [N, K / g]; g a multiple of 8 dividing 2048: int4_group). `data` [N / 16,
        8 K] uint8 (a block's 16 rows of K / 2 bytes) in csrc/cpu_linear_int4.cpp's order (lanes where
        products round x to bf16, else planes), `scale` [N / 16, K / g, 2, 16]: the scales, then the
        offsets."""
        variant = variant or VARIANT
        n, k = q.shape
        group = k // max(scale.shape[1], 1)
        if tuple(scale.shape) != (n, k // group) or tuple(offset.shape) != tuple(scale.shape):
            raise ValueError(f"int4 scales {tuple(scale.shape)} / {tuple(offset.shape)} for [{n}, {k}]")
        if int4_group(group, k) != group:
            raise ValueError(f"int4 groups of {group} k: a multiple of 8 dividing 2048 and K={k}")
        blocks = -(-n // 16)
        w = F.pad(q.detach().to(torch.uint8), (0, 0, 0, blocks * 16 - n))
        if int8_rounds_x(variant):  # lanes: [block, j, row, parity, nibble t], k = 8j + 2t + parity
            w = w.reshape(blocks, 16, k // 8, 4, 2).permute(0, 2, 1, 4, 3).reshape(blocks, k // 8, 64, 2)
        else:  # planes: [block, j, half, parity, row], k = 4j + 2 half + parity
            w = w.reshape(blocks, 16, k // 4, 2, 2).permute(0, 2, 3, 4, 1).reshape(blocks, k // 4, 2, 32)
            w = w.transpose(2, 3)
        data = (w[..., 0] | (w[..., 1] << 4)).reshape(blocks, 8 * k).contiguous()
        so = torch.stack([scale.detach().float(), offset.detach().float()])  # [2, N, G]
        so = F.pad(so, (0, 0, 0, blocks * 16 - n)).reshape(2, blocks, 16, k // group)
        return cls(data, n, k, variant, so.permute(1, 3, 0, 2).contiguous(), group, code=INT4)

    def unpack(self) -> torch.Tensor:
        """The [N, K] weight back (int8: the values, without the scale; int4: q)."""
        if self.code == INT4:
            blocks, k = self.data.shape[0], self.data.shape[1] // 8
            w = torch.stack([self.data & 15, self.data >> 4], dim=-1)  # each byte's nibbles, low first
            if int8_rounds_x(self.variant):  # [block, j, row, parity, t] -> [block, row, j, t, parity]
                w = w.reshape(blocks, k // 8, 16, 2, 4).permute(0, 2, 1, 4, 3)
            else:  # [block, j, parity, row, half] -> [block, row, j, half, parity]
                w = w.reshape(blocks, k // 4, 2, 16, 2).permute(0, 3, 1, 4, 2)
            w = w.reshape(blocks * 16, k)
        elif self.code == W8A8:
            blocks, quads, rows, _ = self.data.shape
            w = self.data.permute(0, 2, 1, 3).reshape(blocks * rows, quads * 4)
        elif self.data.dim() == 3:
            blocks, k, rows = self.data.shape
            w = self.data.permute(0, 2, 1).reshape(blocks * rows, k)
        elif self.data.dtype == torch.int8:
            blocks, pairs, _, rows = self.data.shape
            w = self.data.permute(0, 3, 1, 2).reshape(blocks * rows, pairs * 2)
        else:
            blocks, pairs, rows, _ = self.data.shape
            w = self.data.permute(0, 2, 1, 3).reshape(blocks * rows, pairs * 2)
        w = w[: self.out_features, : self.in_features]
        return w.contiguous().view(torch.float8_e4m3fn) if self.code == FP8 else w

    def scales(self) -> torch.Tensor | None:
        """An int8 weight's scale as given to pack ([N] or [N, K / g]); an int4 one's scale and offset,
        stacked ([2, N, K / g])."""
        if self.code == W8A8:
            return self.scale[0]
        if self.code == INT4:
            blocks, groups, _, rows = self.scale.shape
            return self.scale.permute(2, 0, 3, 1).reshape(2, blocks * rows, groups)[:, : self.out_features]
        if not self.group:
            return self.scale
        blocks, groups, rows = self.scale.shape
        return self.scale.permute(0, 2, 1).reshape(blocks * rows, groups)[: self.out_features]

    def rows(self, ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """Rows `ids` (1-D) of an int8 weight dequantized, [len(ids), K] in dtype, read from the layout:
        the lookup of an embedding table held for its tied LM head's product."""
        if self.code != CODES[torch.int8] or self.scale is None:
            raise ValueError(f"row lookup of a packed weight of code {self.code}")
        block, row = ids // 16, ids % 16
        q = self.data[block, :, :, row].reshape(len(ids), -1)[:, : self.in_features]  # [T, K2 / 2, 2]
        if not self.group:
            return (q.float() * self.scale[ids][:, None]).to(dtype)
        scale = self.scale[block, :, row]  # [T, K / g]
        return (q.float().view(len(ids), -1, self.group) * scale[..., None]).view(len(ids), -1).to(dtype)

    def dequantize(self, dtype: torch.dtype) -> torch.Tensor:
        """The weight the product multiplies by, [N, K] in dtype."""
        w, scale = self.unpack(), self.scales()
        if self.code == INT4:
            s, o = (t.repeat_interleave(self.group, dim=1) for t in scale)
            return (w.float() * s + o).to(dtype)
        if scale is None:
            return w.to(dtype)
        if self.group:
            scale = scale.repeat_interleave(self.group, dim=1)
        return (w.float() * (scale if self.group else scale[:, None])).to(dtype)


def linear(x: torch.Tensor, packed: PackedLinear, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x W^T + b in x's dtype (float32 or bfloat16), summed in float32; threads: torch's. bfloat16 x of
    AMX_ONEDNN_ROWS rows or more on a CPU with AMX: oneDNN's product (amx_bf16)."""
    k, n = packed.in_features, packed.out_features
    code = X_CODES.get(x.dtype)
    if x.shape[-1] != k or code is None:
        raise ValueError(f"x {tuple(x.shape)} {x.dtype} against a packed [{n}, {k}] {packed.dtype} weight")
    x2 = x if x.dim() == 2 else x.reshape(-1, k)
    if not x2.is_contiguous():
        x2 = x2.contiguous()
    m = x2.shape[0]
    if (
        m >= AMX_ONEDNN_ROWS
        and packed.code == CODES[torch.bfloat16]
        and x.dtype == torch.bfloat16
        and amx_bf16()
    ):
        if bias is None or bias.dtype == torch.bfloat16:
            y = F.linear(x2, packed.unpack(), bias)
        else:  # a float32 bias added to the product before the one rounding to bfloat16, as ours does
            y = (F.linear(x2, packed.unpack()).float() + bias).to(torch.bfloat16)
        return y if x.dim() == 2 else y.view(*x.shape[:-1], n)
    y = torch.empty((m, n), dtype=x.dtype)
    if bias is not None and (bias.dtype not in X_CODES or not bias.is_contiguous()):
        bias = bias.float().contiguous()
    bias_code, bias_ptr = (0, None) if bias is None else (X_CODES[bias.dtype], bias.data_ptr())
    threads = torch.get_num_threads()
    rc = packed.fn(
        code,
        packed.code,
        x2.data_ptr(),
        y.data_ptr(),
        packed.ptr,
        packed.scale_ptr,
        packed.group,
        bias_code,
        bias_ptr,
        m,
        n,
        k,
        threads,
    )
    if rc != 0:
        raise ValueError(f"the CPU linear kernel refused its arguments (code {rc})")
    return y if x.dim() == 2 else y.view(*x.shape[:-1], n)
