// y = (x W^T) * scale + b on CPU for an int8 weight W [N, K] with a float32 scale per output row (symmetric
// int8 weight-only: --quantization int8, compressed-tensors W8A16), or a scale per row and group of k
// (GGUF's Q8_0: 32), the second half of the library that cpu_linear.cpp begins (driver: cpu_linear.h).
//
// Layout: [N / 16][K2 / 2][2][16] int8, K2 = K rounded up to even, N padded with zero rows: a step is 32
// bytes, the 16 rows' values at k then at k + 1. Whatever the CPU, the weight is read as stored and
// widened in registers (int8 values are exact in bfloat16 and float32); the scale multiplies each
// output's float32 sum once. Group scales: [N / 16][K / g][16] (Int8GroupKernel; on the float32 paths the
// widened weights are multiplied by them: the dequantized weights).
//   AVX-512 BF16: both halves of a step widened to float32, then their bits interleaved into the 16 (k,
//     k + 1) bf16 pairs that _mm512_dpbf16_ps takes (an integer of at most 8 bits has no bits in a
//     float32's low half, so a bf16 is its high half, exactly), against x rounded to bf16 as the bf16
//     kernel rounds it. Above MB_MAX rows, chunks of rows widen the weight again each (measured: widening
//     a piece of it once into the bf16 layout for all chunks, then the bf16 kernel over it, was 5-15%
//     slower at 32-512 rows: the widening overlaps the products in registers, not through memory).
//   AVX-512F without BF16, AVX2 + FMA, or plain loops: widened to float32 and multiplied by x in float32.
// tp_linear_int8_bf16_x() says which: whether x is rounded to bf16.
// FP8 (e4m3) weights with a scale per row take the same layout and kernels, their bytes widened by another
// rule (Fp8Bytes: every e4m3 value is exact in bf16 and float32).

#include "cpu_linear.h"

namespace {

#if defined(__AVX512BF16__)
struct Int8Bytes {  // a step's 32 bytes (16 rows at k, then at k + 1) as the 16 rows' (k, k + 1) bf16 pairs
  static __m512i widen16(const int8_t* wp) {  // 16 values' float32 bits
    return _mm512_castps_si512(
        _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(wp)))));
  }
  static __m512bh pairs(const int8_t* wp) {
    return (__m512bh)_mm512_or_si512(widen16(wp + 16), _mm512_srli_epi32(widen16(wp), 16));
  }
};

// e4m3 to bf16 in each 16-bit lane holding one: normal values move their exponent (bias 7 to 127) and
// mantissa into place; subnormals (exponent 0: m 2^-9) come from a table of 8; the sign is kept.
struct Fp8Bytes {
  static __m512i bf16_lanes(__m512i v) {
    alignas(64) static const uint16_t sub[32] = {0, 0x3b00, 0x3b80, 0x3bc0, 0x3c00, 0x3c20, 0x3c40, 0x3c60};
    const __m512i mag = _mm512_and_si512(v, _mm512_set1_epi16(0x7f));
    const __m512i normal = _mm512_add_epi16(_mm512_slli_epi16(mag, 4), _mm512_set1_epi16(0x3c00));
    const __m512i tiny = _mm512_permutexvar_epi16(mag, _mm512_load_si512(sub));
    const __m512i value = _mm512_mask_blend_epi16(_mm512_cmplt_epu16_mask(mag, _mm512_set1_epi16(8)), normal, tiny);
    return _mm512_or_si512(value, _mm512_slli_epi16(_mm512_and_si512(v, _mm512_set1_epi16(0x80)), 8));
  }
  static __m512bh pairs(const int8_t* wp) {
    const __m512i k0 = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(wp)));
    const __m512i k1 = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(wp + 16)));
    return (__m512bh)bf16_lanes(_mm512_or_si512(k0, _mm512_slli_epi32(k1, 16)));
  }
};

template <class Bytes>
struct Int8KernelT : Traits {
  using W = int8_t;
  using X = uint32_t;  // a pair of bf16
  // Chunks of 8 rows x 3 blocks above 8 rows (the bf16 kernel's 6 x 4 widens each weight for 6 rows):
  // 1.0-1.2x the bf16 kernel at 16-64 rows, against 0.87-0.99x for 6 x 4 (one run, shared machine).
  static constexpr int ROWS = 16, MB_MAX = 8, MB_BIG = 8, NB_MAX = 4, STEP = 32;
  static int nb_for(int64_t m) { return m >= 7 ? 3 : 4; }
  static int64_t steps(int64_t k) { return (k + 1) / 2; }
  static __m512bh pairs(const int8_t* wp) { return Bytes::pairs(wp); }
  template <int MB, int NB>
  static void tile(const Tile& t) {
    dpbf16_tile<Int8KernelT, MB, NB>(t);
  }
};
using Int8Kernel = Int8KernelT<Int8Bytes>;

// Groups along K (GGUF's Q8_0: 32): each group's products summed apart in float32 (in registers), then
// times its scales into the running sums: in registers too where both fit (REGS: narrower tiles from 4
// rows up), else in t.acc (L1).
struct Int8GroupKernel : Int8Kernel {
  static int nb_for(int64_t m) { return m <= 3 ? 4 : m <= 4 ? 3 : m <= 6 ? 2 : m <= 8 ? 1 : 3; }
  template <int MB, int NB>
  static void tile(const Tile& t) {
    const int64_t gs = t.group / 2;  // steps per group
    constexpr bool REGS = 2 * MB * NB + NB + 1 <= 32;
    __m512 acc[MB][NB];
    for (int m = 0; m < MB; ++m)
      for (int b = 0; b < NB; ++b) {
        acc[m][b] = t.accumulate ? _mm512_loadu_ps(t.acc + m * ACC_LD + b * 16) : _mm512_setzero_ps();
        if (!REGS) _mm512_storeu_ps(t.acc + m * ACC_LD + b * 16, acc[m][b]);
      }
    for (int64_t p0 = t.s0; p0 < t.s1; p0 += gs) {
      __m512 part[MB][NB];
      for (int m = 0; m < MB; ++m)
        for (int b = 0; b < NB; ++b) part[m][b] = _mm512_setzero_ps();
      dpbf16_steps<Int8Kernel, MB, NB>(t, p0, p0 + gs, part);
      for (int b = 0; b < NB; ++b) {
        const __m512 sv = _mm512_loadu_ps(t.gscale + b * t.gstride + p0 / gs * 16);
        for (int m = 0; m < MB; ++m) {
          if constexpr (REGS) {
            acc[m][b] = _mm512_fmadd_ps(part[m][b], sv, acc[m][b]);
          } else {
            float* a = t.acc + m * ACC_LD + b * 16;
            _mm512_storeu_ps(a, _mm512_fmadd_ps(part[m][b], sv, _mm512_loadu_ps(a)));
          }
        }
      }
    }
    if constexpr (REGS)
      for (int m = 0; m < MB; ++m)
        for (int b = 0; b < NB; ++b) _mm512_storeu_ps(t.acc + m * ACC_LD + b * 16, acc[m][b]);
  }
};
constexpr bool BF16_X = true;

#elif defined(__AVX512F__)
struct Int8Bytes {  // 16 bytes as float32
  static __m512 widen(const int8_t* wp) {
    return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(wp))));
  }
};

struct Fp8Bytes {  // e4m3: normal values' bits moved into place (exponent bias 7 to 127), subnormals m 2^-9
  static __m512 widen(const int8_t* wp) {
    const __m512i v = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(wp)));
    const __m512i mag = _mm512_and_si512(v, _mm512_set1_epi32(0x7f));
    const __m512i normal = _mm512_add_epi32(_mm512_slli_epi32(mag, 20), _mm512_set1_epi32(120 << 23));
    const __m512i tiny = _mm512_castps_si512(_mm512_mul_ps(_mm512_cvtepi32_ps(mag), _mm512_set1_ps(0x1p-9f)));
    const __m512i value = _mm512_mask_blend_epi32(_mm512_cmplt_epu32_mask(mag, _mm512_set1_epi32(8)), normal, tiny);
    return _mm512_castsi512_ps(
        _mm512_or_si512(value, _mm512_slli_epi32(_mm512_and_si512(v, _mm512_set1_epi32(0x80)), 24)));
  }
};

template <class Bytes>
struct Int8KernelT : Traits {  // 32 zmm: 4 rows x 4 blocks or 8 x 2 of accumulators, 2 weights a block
  using W = int8_t;
  using X = float;
  static constexpr int ROWS = 16, MB_MAX = 8, MB_BIG = 8, NB_MAX = 4, STEP = 32;
  static constexpr bool PAIRED = true;
  static int nb_for(int64_t m) { return m <= 4 ? 4 : 2; }
  static int64_t steps(int64_t k) { return (k + 1) / 2; }
  static __m512 widen(const int8_t* wp) { return Bytes::widen(wp); }
  template <int MB, int NB>
  static void tile(const Tile& t) {
    const int8_t* w = static_cast<const int8_t*>(t.w);
    const float* x = static_cast<const float*>(t.x);
    __m512 acc[MB][NB];
    for (int m = 0; m < MB; ++m)
      for (int b = 0; b < NB; ++b)
        acc[m][b] = t.accumulate ? _mm512_loadu_ps(t.acc + m * ACC_LD + b * 16) : _mm512_setzero_ps();
    for (int64_t p = t.s0; p < t.s1; ++p) {
      __m512 we[NB], wo[NB];
      const float* gs = t.gscale ? t.gscale + 2 * p / t.group * 16 : nullptr;  // the weights dequantized
      for (int b = 0; b < NB; ++b) {
        const int8_t* wp = w + b * t.bstride + p * 32;
        _mm_prefetch(reinterpret_cast<const char*>(wp + 2 * PREFETCH * 32), _MM_HINT_T0);
        we[b] = widen(wp);
        wo[b] = widen(wp + 16);
        if (gs) {
          const __m512 sv = _mm512_loadu_ps(gs + b * t.gstride);
          we[b] = _mm512_mul_ps(we[b], sv), wo[b] = _mm512_mul_ps(wo[b], sv);
        }
      }
      for (int m = 0; m < MB; ++m) {
        const __m512 xe = _mm512_set1_ps(x[m * t.ldx + 2 * p]), xo = _mm512_set1_ps(x[m * t.ldx + 2 * p + 1]);
        for (int b = 0; b < NB; ++b)
          acc[m][b] = _mm512_fmadd_ps(xo, wo[b], _mm512_fmadd_ps(xe, we[b], acc[m][b]));
      }
    }
    for (int m = 0; m < MB; ++m)
      for (int b = 0; b < NB; ++b) _mm512_storeu_ps(t.acc + m * ACC_LD + b * 16, acc[m][b]);
  }
};
using Int8Kernel = Int8KernelT<Int8Bytes>;
constexpr bool BF16_X = false;

#elif defined(__AVX2__) && defined(__FMA__)
struct Int8Bytes {  // 8 bytes as float32
  static __m256 widen(const int8_t* wp) {
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(wp))));
  }
};

struct Fp8Bytes {  // as on AVX-512F
  static __m256 widen(const int8_t* wp) {
    const __m256i v = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(wp)));
    const __m256i mag = _mm256_and_si256(v, _mm256_set1_epi32(0x7f));
    const __m256i normal = _mm256_add_epi32(_mm256_slli_epi32(mag, 20), _mm256_set1_epi32(120 << 23));
    const __m256 tiny = _mm256_mul_ps(_mm256_cvtepi32_ps(mag), _mm256_set1_ps(0x1p-9f));
    const __m256 is_tiny = _mm256_castsi256_ps(_mm256_cmpgt_epi32(_mm256_set1_epi32(8), mag));
    const __m256 value = _mm256_blendv_ps(_mm256_castsi256_ps(normal), tiny, is_tiny);
    const __m256i sign = _mm256_slli_epi32(_mm256_and_si256(v, _mm256_set1_epi32(0x80)), 24);
    return _mm256_or_ps(value, _mm256_castsi256_ps(sign));
  }
};

template <class Bytes>
struct Int8KernelT : Traits {  // 16 ymm: 4 rows x 1 block (2 halves) of accumulators, 4 weights, 2 broadcasts
  using W = int8_t;
  using X = float;
  static constexpr int ROWS = 16, MB_MAX = 4, MB_BIG = 4, NB_MAX = 1, STEP = 32;
  static constexpr bool PAIRED = true;
  static int nb_for(int64_t) { return 1; }
  static int64_t steps(int64_t k) { return (k + 1) / 2; }
  static __m256 widen(const int8_t* wp) { return Bytes::widen(wp); }
  template <int MB, int NB>
  static void tile(const Tile& t) {
    const int8_t* w = static_cast<const int8_t*>(t.w);
    const float* x = static_cast<const float*>(t.x);
    __m256 acc[MB][2];
    for (int m = 0; m < MB; ++m)
      for (int h = 0; h < 2; ++h)
        acc[m][h] = t.accumulate ? _mm256_loadu_ps(t.acc + m * ACC_LD + h * 8) : _mm256_setzero_ps();
    for (int64_t p = t.s0; p < t.s1; ++p) {
      const int8_t* wp = w + p * 32;
      _mm_prefetch(reinterpret_cast<const char*>(wp + 2 * PREFETCH * 32), _MM_HINT_T0);
      __m256 we[2] = {widen(wp), widen(wp + 8)}, wo[2] = {widen(wp + 16), widen(wp + 24)};
      if (t.gscale) {  // the weights dequantized
        const float* gs = t.gscale + 2 * p / t.group * 16;
        for (int h = 0; h < 2; ++h) {
          const __m256 sv = _mm256_loadu_ps(gs + h * 8);
          we[h] = _mm256_mul_ps(we[h], sv), wo[h] = _mm256_mul_ps(wo[h], sv);
        }
      }
      for (int m = 0; m < MB; ++m) {
        const __m256 xe = _mm256_broadcast_ss(x + m * t.ldx + 2 * p);
        const __m256 xo = _mm256_broadcast_ss(x + m * t.ldx + 2 * p + 1);
        for (int h = 0; h < 2; ++h)
          acc[m][h] = _mm256_fmadd_ps(xo, wo[h], _mm256_fmadd_ps(xe, we[h], acc[m][h]));
      }
    }
    for (int m = 0; m < MB; ++m)
      for (int h = 0; h < 2; ++h) _mm256_storeu_ps(t.acc + m * ACC_LD + h * 8, acc[m][h]);
  }
};
using Int8Kernel = Int8KernelT<Int8Bytes>;
constexpr bool BF16_X = false;

#else
struct Int8Bytes {
  static float value(int8_t b) { return b; }
};

struct Fp8Bytes {  // e4m3fn: 1 sign, 4 exponent (bias 7), 3 mantissa bits; 0x7f is NaN
  static float value(int8_t b) {
    const int u = static_cast<uint8_t>(b), e = (u >> 3) & 15, m = u & 7;
    const float v = (u & 0x7f) == 0x7f ? NAN : e ? std::ldexp(1.0f + m / 8.0f, e - 7) : std::ldexp(m, -9);
    return u & 0x80 ? -v : v;
  }
};

template <class Bytes>
struct Int8KernelT : Traits {  // any CPU: plain loops over the same layout
  using W = int8_t;
  using X = float;
  static constexpr int ROWS = 16, MB_MAX = 4, MB_BIG = 4, NB_MAX = 4, STEP = 32;
  static constexpr bool PAIRED = true;
  static int nb_for(int64_t) { return NB_MAX; }
  static int64_t steps(int64_t k) { return (k + 1) / 2; }
  template <int MB, int NB>
  static void tile(const Tile& t) {
    const int8_t* w = static_cast<const int8_t*>(t.w);
    const float* x = static_cast<const float*>(t.x);
    for (int m = 0; m < MB; ++m)
      for (int j = 0; j < NB * 16; ++j) {
        float a = t.accumulate ? t.acc[m * ACC_LD + j] : 0.0f;
        const int8_t* wb = w + (j / 16) * t.bstride + j % 16;
        const float* gs = t.gscale ? t.gscale + (j / 16) * t.gstride + j % 16 : nullptr;
        for (int64_t p = t.s0; p < t.s1; ++p) {
          const float s = gs ? gs[2 * p / t.group * 16] : 1.0f;  // the weights dequantized
          a += x[m * t.ldx + 2 * p] * (Bytes::value(wb[p * 32]) * s);
          a += x[m * t.ldx + 2 * p + 1] * (Bytes::value(wb[p * 32 + 16]) * s);
        }
        t.acc[m * ACC_LD + j] = a;
      }
  }
};
using Int8Kernel = Int8KernelT<Int8Bytes>;
constexpr bool BF16_X = false;
#define TP_INT8_SCALAR
#endif
using Fp8Kernel = Int8KernelT<Fp8Bytes>;
#if !defined(__AVX512BF16__)
using Int8GroupKernel = Int8Kernel;  // the group scales multiply the widened weights
#endif

// W8A8 (compressed-tensors int-quantized with dynamic per-token activations): x quantized per row
// (quantized_input), weights [N / 16][K4 / 4][16][4], K4 = K rounded up to a multiple of 4: a 64-byte line
// is 16 rows x 4 k, what one _mm512_dpbusd_epi32 takes against a broadcast quad of x's bytes. Exact int32
// sums; the driver subtracts 128 sum(q) and applies both scales.
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
struct W8A8Kernel : Traits {
  using W = int8_t;
  using X = uint32_t;  // four x_q + 128
  static constexpr int ROWS = 16, MB_MAX = 8, MB_BIG = 6, NB_MAX = 4, STEP = 64;
  static constexpr bool QUADS = true;
  // Above 8 rows, chunks of 6 x 3 blocks: 1.5-1.7x faster than 6 x 4 at 32-64 rows (measured).
  static int nb_for(int64_t m) { return m >= 7 ? 3 : 4; }
  static int64_t steps(int64_t k) { return (k + 3) / 4; }
  template <int MB, int NB>
  static void tile(const Tile& t) {
    const int8_t* w = static_cast<const int8_t*>(t.w);
    const int32_t* x = static_cast<const int32_t*>(t.x);
    __m512i acc[MB][NB];
    for (int m = 0; m < MB; ++m)
      for (int b = 0; b < NB; ++b)
        acc[m][b] = t.accumulate ? _mm512_loadu_si512(t.acc + m * ACC_LD + b * 16) : _mm512_setzero_si512();
    for (int64_t p = t.s0; p < t.s1; ++p) {
      __m512i wv[NB];
      for (int b = 0; b < NB; ++b) {
        const int8_t* wp = w + b * t.bstride + p * 64;
        _mm_prefetch(reinterpret_cast<const char*>(wp + PREFETCH * 64), _MM_HINT_T0);
        wv[b] = _mm512_loadu_si512(wp);
      }
      for (int m = 0; m < MB; ++m) {
        const __m512i xv = _mm512_set1_epi32(x[m * t.ldx + p]);
        for (int b = 0; b < NB; ++b) acc[m][b] = _mm512_dpbusd_epi32(acc[m][b], xv, wv[b]);
      }
    }
    for (int m = 0; m < MB; ++m)
      for (int b = 0; b < NB; ++b) _mm512_storeu_si512(t.acc + m * ACC_LD + b * 16, acc[m][b]);
  }
};
constexpr bool W8A8_NATIVE = true;
#else
struct W8A8Kernel : Traits {  // plain loops (the caller keeps fbgemm on such CPUs)
  using W = int8_t;
  using X = uint32_t;
  static constexpr int ROWS = 16, MB_MAX = 4, MB_BIG = 4, NB_MAX = 4, STEP = 64;
  static constexpr bool QUADS = true;
  static int nb_for(int64_t) { return NB_MAX; }
  static int64_t steps(int64_t k) { return (k + 3) / 4; }
  template <int MB, int NB>
  static void tile(const Tile& t) {
    const int8_t* w = static_cast<const int8_t*>(t.w);
    const uint32_t* x = static_cast<const uint32_t*>(t.x);
    for (int m = 0; m < MB; ++m)
      for (int j = 0; j < NB * 16; ++j) {
        int32_t a = 0;
        if (t.accumulate) std::memcpy(&a, t.acc + m * ACC_LD + j, 4);
        const int8_t* wb = w + (j / 16) * t.bstride + (j % 16) * 4;
        for (int64_t p = t.s0; p < t.s1; ++p)
          for (int i = 0; i < 4; ++i)
            a += static_cast<int32_t>((x[m * t.ldx + p] >> (8 * i)) & 255) * wb[p * 64 + i];
        std::memcpy(t.acc + m * ACC_LD + j, &a, 4);
      }
  }
};
constexpr bool W8A8_NATIVE = false;
#endif

}  // namespace

extern "C" {

// group 0: scale [N]; else [N / 16][K / group][16], group even and dividing K and 2048 (a piece's k).
void tp_linear_int8_run(int x_dtype, const void* x, void* y, const void* w, const float* scale, int64_t group,
                        int bias_dtype, const void* bias, int64_t m, int64_t n, int64_t k, int threads) {
  if (group)
    run<Int8GroupKernel>(Call{x_dtype, x, y, w, bias_dtype, bias, nullptr, m, n, k, scale, group}, threads);
  else
    run<Int8Kernel>(Call{x_dtype, x, y, w, bias_dtype, bias, scale, m, n, k}, threads);
}

// e4m3 weights in the int8 layout with a float32 scale per row.
void tp_linear_fp8_run(int x_dtype, const void* x, void* y, const void* w, const float* scale, int bias_dtype,
                       const void* bias, int64_t m, int64_t n, int64_t k, int threads) {
  run<Fp8Kernel>(Call{x_dtype, x, y, w, bias_dtype, bias, scale, m, n, k}, threads);
}

// scale: float32 [2, N], the weight scales then each row's sum of q (exact in float32).
void tp_linear_w8a8_run(int x_dtype, const void* x, void* y, const void* w, const float* scale, int bias_dtype,
                        const void* bias, int64_t m, int64_t n, int64_t k, int threads) {
  run<W8A8Kernel>(Call{x_dtype, x, y, w, bias_dtype, bias, scale, m, n, k}, threads);
}

#if defined(TP_INT8_SCALAR)
int tp_linear_int8_native() { return 0; }
#else
int tp_linear_int8_native() { return 1; }
#endif
int tp_linear_w8a8_native() { return W8A8_NATIVE; }

// Whether x is rounded to bf16 for the product (else multiplied in float32).
int tp_linear_int8_bf16_x() { return BF16_X; }

}  // extern "C"
