"""Weight-only int8 and int4 products, held in the layout of the kernel chosen for the device.

PackedInt8: symmetric int8 per output channel, w[n, k] = q[n, k] * scale[n].
PackedInt4: 4-bit in groups of group_size along K, w[n, k] = (q[n, k] - zero[n, k // g]) * scale[n, k // g]
(zero may be non-integer: GGUF's Q4_K min offsets; None means symmetric, zero 8).

Chosen by bench/quant_kernels.py (its header holds the table), on CPU, the same on AVX-512 and AVX2:
  int8: on a CPU where our own kernel runs, int8 layers go through it (products.pack_int8,
        cpu_linear.py's table: weight-only 1.4-1.7x our bf16 kernel at 1 row, 1.1x at 32, 2.2-3.5x
        _weight_int8pack_mm; W8A8 on AVX-512 VNNI 1.5-2.0x fbgemm; AMD EPYC Zen 4, AVX-512 BF16 + VNNI,
        no AMX, one thread, shared machine). PackedInt8 serves the others:
        matmul: aten._weight_int8pack_mm (int8 weight, bf16 activations: its float32 path is 2-8x
        slower; per-channel scale in the kernel); it needs K % 16 == 0. At batch 1: 3.3-4.0x float32
        and 1.6-2.6x bf16 on Llama-3-8B's shapes, 1.0-1.7x float32 and 0.86-1.0x bf16 on SmolLM2's
        (bf16 there: oneDNN's product, before our kernel).
  int4: on a CPU where our own kernel runs (cpu_linear.available_int4: AVX-512 or AVX2 + FMA), through
        it (cpu_linear.PackedLinear.pack_int4, csrc/cpu_linear_int4.cpp, at the group int4_group
        gives; cpu_linear.py's table: 1.13x the int8 kernel at 1 row on SmolLM2's products, 1.60x on a
        Llama-3-8B layer, 1.2-2.1x tinygemm at 1-32 rows). Else
        aten._weight_int4pack_mm_for_cpu (the "tinygemm" layout, repacked once here by
        _convert_weight_to_int4pack_for_cpu; its form of the affine rule is w = (q - 8) * s + m, so
        m = (8 - zero) * s). It needs N % 16 == 0 and a group of 32, 64, 128 or 256 (a larger group
        that one of them divides, per-channel included, is served by repeating its scales). At batch 1
        1.4-5.5x the int8 kernel, 1.5-12x bf16.
  W8A8 (PackedInt8.matmul_dynamic): activations quantized per token to int8, through fbgemm's dynamic
        linear (before our kernel, the fastest int8 product measured at every batch; on the large shapes
        2.1-12x bf16 at one row and 1.0-1.6x from 8 rows up, where both weight-only kernels fall behind
        bf16, their cost growing with M). Its quantization of x is its own (one u8 range, pinned):
        up to ~1% off the per-token rule that our kernel and the float64 path follow exactly.
Activations go to the kernels in bfloat16 and results come back in x's dtype (as --linear-dtype bfloat16
does for the unquantized layers). Anything a kernel cannot take (another device, odd shapes, float64)
falls back to dequantize() + F.linear per call: correct, and as slow as it sounds; `kernel` names which
one a packed weight uses.

On CUDA (kernels.TRITON_DEVICES) both run quant/triton_linear.py's Triton weight-only GEMM (x in float16,
bfloat16 or float32; float32 accumulation): int8 as held, int4 as the plain nibbles below with its scales
(and zeros) transposed once to [K / g, N]; an int4 group whose power-of-two part is under 16 is dequantized.
Its tiles are untuned (no GPU lent when written); bench/gpu_check.py's quant part times it.

Both are nn.Modules whose tensors are non-persistent buffers: a layer holds one as an attribute (a
submodule), `.to(device)` moves it with the model, and they stay out of state_dict and named_parameters
(the loader fills parameters, and the packed form is derived from them after loading). Moving an int4
weight repacks it for the new device (the CPU layout is the kernel's, not a plain one). `nbytes` is what
one holds (not visible to vars(): it is a Module).
"""

from __future__ import annotations

import functools
import warnings

import torch
import torch.nn.functional as F
from torch import nn

from shard_worker.model.quant import cpu_linear

INT4_GROUPS = (32, 64, 128, 256)  # what _weight_int4pack_mm_for_cpu takes
# Devices whose weights the Triton kernels (quant/triton_linear.py) multiply. Only CUDA in a server; the
# interpreted tests (tests/unit/triton_linear_cases.py) add "cpu" to run the same wiring on CPU tensors.
TRITON_DEVICES = ("cuda",)
_ENGINES = set(torch.backends.quantized.supported_engines)
_KERNEL_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


@functools.cache
def _int_mm_exact() -> bool:
    """Whether torch._int_mm returns exact int32 sums here. oneDNN without VNNI (AVX2 dispatch,
    measured with ONEDNN_MAX_CPU_ISA=AVX2) saturates 16-bit pair sums: errors of ~6e4 on random rows."""
    a = torch.full((2, 64), 127, dtype=torch.int8)
    a[1] = -127
    b = torch.full((64, 16), 127, dtype=torch.int8)
    try:
        return torch.equal(torch._int_mm(a, b), a.int() @ b.int())
    except RuntimeError:
        return False


@functools.cache
def _reduce_range() -> bool:
    """Whether fbgemm's dynamic linear must keep activations to 7 bits: its u8 x s8 products without
    VNNI (vpmaddubsw) saturate 16-bit pair sums at 8 bits. Checked on a worst case once."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        qw = torch._make_per_channel_quantized_tensor(
            torch.full((16, 64), 127, dtype=torch.int8), torch.ones(16).double(), torch.zeros(16).long(), 0
        )
    y = torch.ops.quantized.linear_dynamic(torch.ones(1, 64), torch.ops.quantized.linear_prepack(qw, None))
    return not bool(((y - 127 * 64).abs() < 1).all())


def cpu_kind() -> str:
    """The CPU's vector ISA as torch sees it ("AVX512", "AVX2", ...), and whether oneDNN multiplies
    bfloat16 natively: the two facts the kernel choice can depend on."""
    capability = torch.backends.cpu.get_cpu_capability()
    bf16 = torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported()
    return f"{capability}, native bf16 {'yes' if bf16 else 'no'}"


@functools.cache
def _triton_importable() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def triton_serves(device: torch.device) -> bool:
    """Whether weights on this device go to the Triton kernels."""
    return device.type in TRITON_DEVICES and _triton_importable()


def _triton():
    from shard_worker.model.quant import triton_linear  # imports triton: only where it runs

    return triton_linear


def _rows(x: torch.Tensor) -> torch.Tensor:
    """x as the kernels take it: 2-D, contiguous, bfloat16 (their float32 paths measured 6-100x slower
    than their bfloat16 ones, bench/quant_kernels.py)."""
    return x.reshape(-1, x.shape[-1]).to(torch.bfloat16).contiguous()


class PackedInt8(nn.Module):
    """Symmetric per-output-channel int8 weight. matmul keeps x's precision for activations;
    matmul_dynamic is W8A8 (activations quantized per token)."""

    def __init__(self, q: torch.Tensor, scale: torch.Tensor):
        super().__init__()
        self.register_buffer("q", q, persistent=False)  # int8 [N, K]
        self.register_buffer("scale", scale, persistent=False)  # float32 [N]
        self.register_buffer("scale_bf16", scale.to(torch.bfloat16), persistent=False)
        self._fbgemm = None  # matmul_dynamic's packed weight, built on first use
        self._fits_on = None

    @classmethod
    def pack(cls, q: torch.Tensor, scale: torch.Tensor) -> PackedInt8:
        if q.dtype != torch.int8 or q.dim() != 2:
            raise ValueError(f"PackedInt8 wants int8 [N, K], got {q.dtype} {tuple(q.shape)}")
        if tuple(scale.shape) != (q.shape[0],):
            raise ValueError(f"PackedInt8 scale shape {tuple(scale.shape)}, expected ({q.shape[0]},)")
        return cls(q.contiguous(), scale.to(device=q.device, dtype=torch.float32).contiguous())

    @property
    def kernel(self) -> str:
        self._fits()
        return self._kernel_name

    def _fits(self) -> bool:
        """Whether _weight_int8pack_mm takes this weight here (the Triton kernel: _kernel_name says)."""
        # Its AVX-512 path reads K in blocks of 16 and returns garbage or crashes otherwise (measured).
        # Cached per device (read per product; a property costs ~4 us a call here).
        if self._fits_on is not self.q.device:
            device = self.q.device
            self._fits_on = device
            self._fits_q = not triton_serves(device) and device.type == "cpu" and self.q.shape[1] % 16 == 0
            self._triton = triton_serves(device)
            self._kernel_name = "triton int8" if self._triton else (
                "weight_int8pack_mm" if self._fits_q else "dequantize"
            )  # fmt: skip
        return self._fits_q

    @property
    def nbytes(self) -> int:
        """Bytes held: q and its float32 scales (bf16 copy included), plus fbgemm's copy of q once a W8A8
        product has built it (a layer used only W8A8 could drop q: not done, dequantize() reads it)."""
        fbgemm = self.q.numel() if self._fbgemm is not None else 0
        return self.q.numel() + 6 * self.scale.numel() + fbgemm

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., K] (float32 or bfloat16) -> x W^T [..., N] in x.dtype."""
        fits = self._fits()
        if self._triton and x.dtype in _KERNEL_DTYPES:
            return _triton().int8_matmul(x, self.q, self.scale)
        if not fits or x.dtype not in _KERNEL_DTYPES:
            return F.linear(x, self.dequantize(x.dtype))
        y = torch.ops.aten._weight_int8pack_mm(_rows(x), self.q, self.scale_bf16)
        return y.to(x.dtype).reshape(*x.shape[:-1], y.shape[-1])

    def matmul_dynamic(self, x: torch.Tensor) -> torch.Tensor:
        """W8A8: each row of x quantized to int8 by its own absmax (symmetric, per token), int8 products
        summed in int32, then scaled by the row's and the channel's scales; [..., N] in x.dtype.

        On CPU through fbgemm's dynamic linear, which quantizes its whole input with one range (the
        span of its values and 0, 255 steps): for one row that is the row's own, a grid at least as fine
        as absmax / 127, used as it is; for more, each row is divided by its absmax first (and the result
        multiplied back), and one extra row [-1, 1, 0..] pins the range to [-1, 1], so every row is
        quantized by its own absmax whatever else is in the batch (the pinning costs ~40 us a product
        on SmolLM2's shapes, measured, which a batch of one skips). Elsewhere (or without fbgemm) the
        per-token rule through torch._int_mm, where it is exact."""
        rows = x.reshape(-1, x.shape[-1]).float()
        # Other dtypes (float64 tests) take the per-token rule exactly as written (products.py's).
        packed = self._fbgemm_weight() if x.dtype in (torch.float32, torch.bfloat16) else None
        if packed is not None and rows.shape[0] == 1:  # its one range is this row's own
            y = torch.ops.quantized.linear_dynamic(rows, packed, _reduce_range())
            return y.to(x.dtype).reshape(*x.shape[:-1], y.shape[-1])
        absmax = rows.abs().amax(dim=-1, keepdim=True).clamp(min=torch.finfo(torch.float32).tiny)
        if packed is not None:
            pinned = torch.cat([rows / absmax, self._pin_row], dim=0)
            y = torch.ops.quantized.linear_dynamic(pinned, packed, _reduce_range())[:-1] * absmax
        else:
            x_scale = absmax / 127
            xq = torch.round(rows / x_scale).clamp(-127, 127).to(torch.int8)
            cpu = self.q.device.type == "cpu"
            if (cpu and _int_mm_exact()) or (not cpu and xq.shape[0] > 16):  # CUDA's wants > 16 rows
                acc = torch._int_mm(xq, self.q.t()).float()
            else:  # exact in float32 while K * 127^2 < 2^24 (K <= 1040), float32-rounded beyond
                acc = F.linear(xq.float(), self.q.float())
            y = acc * x_scale * self.scale
        return y.to(x.dtype).reshape(*x.shape[:-1], y.shape[-1])

    def _fbgemm_weight(self):
        """fbgemm's packed form of q, built on the first W8A8 product (CPU only; None if unavailable)."""
        if self._fbgemm is None and self.q.device.type == "cpu" and "fbgemm" in _ENGINES:
            n, k = self.q.shape
            zeros = torch.zeros(n, dtype=torch.long)
            with warnings.catch_warnings():  # quantized tensors are deprecated; torch is pinned
                warnings.simplefilter("ignore", UserWarning)
                qw = torch._make_per_channel_quantized_tensor(self.q, self.scale.double(), zeros, 0)
            self._fbgemm = torch.ops.quantized.linear_prepack(qw, None)
            self._pin_row = torch.zeros(1, k)
            self._pin_row[0, :2] = torch.tensor([-1.0, 1.0])
        return self._fbgemm

    def _apply(self, fn, recurse=True):
        self._fbgemm = None  # rebuilt from q where it lands
        return super()._apply(fn, recurse)

    def dequantize(self, dtype: torch.dtype) -> torch.Tensor:
        return (self.q.float() * self.scale[:, None]).to(dtype)


class PackedInt4(nn.Module):
    """4-bit weight in groups along K, in the tinygemm CPU layout where the shape allows it, else as
    plain nibbles (two per byte along K, low nibble first) dequantized per product."""

    def __init__(self, q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor | None, group_size: int):
        super().__init__()
        self.group_size = group_size
        self.shape = tuple(q.shape)
        self.register_buffer("scale", scale, persistent=False)  # float32 [N, K // g]
        self.register_buffer("zero", zero, persistent=False)  # float32 [N, K // g] or None (8)
        self._place(q)

    @classmethod
    def pack(
        cls, q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor | None, group_size: int
    ) -> PackedInt4:
        if q.dim() != 2 or q.dtype.is_floating_point or q.dtype == torch.bool:
            raise ValueError(f"PackedInt4 wants uint8 [N, K], got {q.dtype} {tuple(q.shape)}")
        n, k = q.shape
        if group_size <= 0 or k % group_size:
            raise ValueError(f"PackedInt4: K={k} is not a multiple of group_size {group_size}")
        groups = (n, k // group_size)
        if tuple(scale.shape) != groups or (zero is not None and tuple(zero.shape) != groups):
            raise ValueError(f"PackedInt4: scale/zero must be {groups}")
        if q.numel() and (int(q.max()) > 15 or int(q.min()) < 0):
            raise ValueError("PackedInt4: values must be 0..15")
        q = q.to(torch.uint8)
        as_f32 = {"device": q.device, "dtype": torch.float32}
        zero = None if zero is None else zero.to(**as_f32).contiguous()
        return cls(q, scale.to(**as_f32).contiguous(), zero, group_size)

    def _place(self, q: torch.Tensor) -> None:
        """Stores q in the layout of the kernel this device and shape allow."""
        n, k = self.shape
        self.triton = triton_serves(q.device) and _triton().serves_groups(self.group_size, k)
        cpu = q.device.type == "cpu" and not self.triton
        # Our CPU kernel (cpu_linear.pack_int4) at its group, a divisor of group_size, or else tinygemm at
        # its own: group_size itself or a divisor of it it takes (per-channel and group 512 weights
        # repeat their scales over it, exactly).
        group = cpu_linear.int4_group(self.group_size, k) if cpu and cpu_linear.available_int4() else 0
        self.cpu_packed = None
        self.kernel_group = next((g for g in reversed(INT4_GROUPS) if self.group_size % g == 0), 0)
        self.tinygemm = not group and cpu and n % 16 == 0 and self.kernel_group > 0
        if group:
            repeat = self.group_size // group
            scale = self.scale.repeat_interleave(repeat, dim=1)
            zero = 8.0 if self.zero is None else self.zero.repeat_interleave(repeat, dim=1)
            self.cpu_packed = cpu_linear.PackedLinear.pack_int4(q, scale, -zero * scale)
            packed = self.cpu_packed.data
        elif self.tinygemm:
            packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q.to(torch.int32), 1)
        else:
            padded = F.pad(q, (0, k % 2))
            packed = (padded[:, 0::2] | (padded[:, 1::2] << 4)).contiguous()
        self.register_buffer("qweight", packed, persistent=False)
        self._kernel_scales = {}  # dtype -> [K // g, N, 2] (scale, offset), built on first use
        # The Triton kernel reads a K step's scales (and zeros) for BLOCK_N channels as one row.
        transposed = self.triton and self.zero is not None
        self.register_buffer(
            "scale_t", self.scale.t().contiguous() if self.triton else None, persistent=False
        )
        self.register_buffer("zero_t", self.zero.t().contiguous() if transposed else None, persistent=False)

    @property
    def kernel(self) -> str:
        if self.triton:
            return "triton int4"
        if self.cpu_packed is not None:
            return "cpu_linear int4"
        return "weight_int4pack_mm_for_cpu" if self.tinygemm else "dequantize"

    @property
    def nbytes(self) -> int:
        if self.cpu_packed is not None:  # its scales and offsets at the kernel's group
            return self.qweight.numel() + 4 * self.cpu_packed.scale.numel()
        groups = 4 * self.scale.numel() * (1 if self.zero is None else 2)
        return self.qweight.numel() + groups * (2 if self.triton else 1)  # the transposed copies

    def _scales_and_offsets(self, dtype: torch.dtype) -> torch.Tensor:
        if dtype not in self._kernel_scales:
            zero = 8.0 if self.zero is None else self.zero
            offset = (8 - zero) * self.scale
            stacked = torch.stack([self.scale, offset.expand_as(self.scale)], dim=-1)
            stacked = stacked.repeat_interleave(self.group_size // self.kernel_group, dim=1)
            self._kernel_scales[dtype] = stacked.transpose(0, 1).contiguous().to(dtype)
        return self._kernel_scales[dtype]

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., K] (float32 or bfloat16) -> x W^T [..., N] in x.dtype."""
        if self.triton and x.dtype in _KERNEL_DTYPES:
            return _triton().int4_matmul(x, self.qweight, self.scale_t, self.zero_t, self.group_size)
        if self.cpu_packed is not None and x.dtype in cpu_linear.X_CODES:
            return cpu_linear.linear(x, self.cpu_packed)
        if not self.tinygemm or x.dtype not in _KERNEL_DTYPES:
            return F.linear(x, self.dequantize(x.dtype))
        y = torch.ops.aten._weight_int4pack_mm_for_cpu(
            _rows(x), self.qweight, self.kernel_group, self._scales_and_offsets(torch.bfloat16)
        )
        return y.to(x.dtype).reshape(*x.shape[:-1], y.shape[-1])

    def unpack(self) -> torch.Tensor:
        """q as given to pack (uint8 [N, K])."""
        n, k = self.shape
        if self.cpu_packed is not None:
            return self.cpu_packed.unpack()
        if not self.tinygemm:
            plain = torch.stack([self.qweight & 15, self.qweight >> 4], dim=-1).reshape(n, -1)
            return plain[:, :k].contiguous()
        # The tinygemm layout depends on the ISA's block sizes: read where each (n, k) lands by packing
        # its flat index, one hex digit at a time, through the same conversion.
        where = torch.zeros(n * k, dtype=torch.int64)
        index = torch.arange(n * k, dtype=torch.int64).reshape(n, k)
        digit = 0
        while (n * k - 1) >> (4 * digit):
            code = torch.ops.aten._convert_weight_to_int4pack_for_cpu(
                ((index >> (4 * digit)) & 15).to(torch.int32), 1
            )
            where |= _nibbles(code).long() << (4 * digit)
            digit += 1
        q = torch.empty(n * k, dtype=torch.uint8)
        q[where] = _nibbles(self.qweight)
        return q.reshape(n, k)

    def dequantize(self, dtype: torch.dtype) -> torch.Tensor:
        q = self.unpack().float()
        zero = 8.0 if self.zero is None else self.zero.repeat_interleave(self.group_size, dim=1)
        return ((q - zero) * self.scale.repeat_interleave(self.group_size, dim=1)).to(dtype)

    def _apply(self, fn, recurse=True):
        # The tinygemm layout is the CPU kernel's: a device move repacks from the plain values.
        q = self.unpack()
        super()._apply(fn, recurse)
        self._place(q.to(self.scale.device))
        return self


def _nibbles(packed: torch.Tensor) -> torch.Tensor:
    """A packed uint8 tensor's nibbles in storage order (each byte's low nibble, then its high one)."""
    return torch.stack([packed & 15, packed >> 4], dim=-1).reshape(-1)
