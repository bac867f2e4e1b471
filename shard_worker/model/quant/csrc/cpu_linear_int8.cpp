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

#include "cpu_linear.h"

namespace {

#if defined(__AVX512BF16__)
struct Int8Kernel : Traits {
  using W = int8_t;
  using X = uint32_t;  // a pair of bf16
  // Chunks of 8 rows x 3 blocks above 8 rows (the bf16 kernel's 6 x 4 widens each weight for 6 rows):
  // 1.0-1.2x the bf16 kernel at 16-64 rows, against 0.87-0.99x for 6 x 4 (one run, shared machine).
  static constexpr int ROWS = 16, MB_MAX = 8, MB_BIG = 8, NB_MAX = 4, STEP = 32;
  static int nb_for(int64_t m) { return m >= 7 ? 3 : 4; }
  static int64_t steps(int64_t k) { return (k + 1) / 2; }
  static __m512i widen16(const int8_t* wp) {  // 16 values' float32 bits
    return _mm512_castps_si512(
        _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(wp)))));
  }
  static __m512bh pairs(const int8_t* wp) {
    return (__m512bh)_mm512_or_si512(widen16(wp + 16), _mm512_srli_epi32(widen16(wp), 16));
  }
  template <int MB, int NB>
  static void tile(const Tile& t) {
    dpbf16_tile<Int8Kernel, MB, NB>(t);
  }
};

// Groups along K (GGUF's Q8_0: 32): each group's products summed apart in float32 (in registers), then
// times its scales into the running sums (kept in t.acc, in L1: the registers hold the partial sums, so the
// tiles are as large as Int8Kernel's).
struct Int8GroupKernel : Int8Kernel {
  template <int MB, int NB>
  static void tile(const Tile& t) {
    const int64_t gs = t.group / 2;  // steps per group
    if (!t.accumulate)
      for (int m = 0; m < MB; ++m)
        for (int b = 0; b < NB; ++b) _mm512_storeu_ps(t.acc + m * ACC_LD + b * 16, _mm512_setzero_ps());
    for (int64_t p0 = t.s0; p0 < t.s1; p0 += gs) {
      __m512 part[MB][NB];
      for (int m = 0; m < MB; ++m)
        for (int b = 0; b < NB; ++b) part[m][b] = _mm512_setzero_ps();
      dpbf16_steps<Int8Kernel, MB, NB>(t, p0, p0 + gs, part);
      for (int b = 0; b < NB; ++b) {
        const __m512 sv = _mm512_loadu_ps(t.gscale + b * t.gstride + p0 / gs * 16);
        for (int m = 0; m < MB; ++m) {
          float* a = t.acc + m * ACC_LD + b * 16;
          _mm512_storeu_ps(a, _mm512_fmadd_ps(part[m][b], sv, _mm512_loadu_ps(a)));
        }
      }
    }
  }
};
constexpr bool BF16_X = true;

#elif defined(__AVX512F__)
struct Int8Kernel : Traits {  // 32 zmm: 4 rows x 4 blocks or 8 x 2 of accumulators, 2 weights a block
  using W = int8_t;
  using X = float;
  static constexpr int ROWS = 16, MB_MAX = 8, MB_BIG = 8, NB_MAX = 4, STEP = 32;
  static constexpr bool PAIRED = true;
  static int nb_for(int64_t m) { return m <= 4 ? 4 : 2; }
  static int64_t steps(int64_t k) { return (k + 1) / 2; }
  static __m512 widen(const int8_t* wp) {
    return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(wp))));
  }
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
constexpr bool BF16_X = false;

#elif defined(__AVX2__) && defined(__FMA__)
struct Int8Kernel : Traits {  // 16 ymm: 4 rows x 1 block (2 halves) of accumulators, 4 weights, 2 broadcasts
  using W = int8_t;
  using X = float;
  static constexpr int ROWS = 16, MB_MAX = 4, MB_BIG = 4, NB_MAX = 1, STEP = 32;
  static constexpr bool PAIRED = true;
  static int nb_for(int64_t) { return 1; }
  static int64_t steps(int64_t k) { return (k + 1) / 2; }
  static __m256 widen(const int8_t* wp) {
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(wp))));
  }
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
constexpr bool BF16_X = false;

#else
struct Int8Kernel : Traits {  // any CPU: plain loops over the same layout
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
          a += x[m * t.ldx + 2 * p] * (wb[p * 32] * s);
          a += x[m * t.ldx + 2 * p + 1] * (wb[p * 32 + 16] * s);
        }
        t.acc[m * ACC_LD + j] = a;
      }
  }
};
constexpr bool BF16_X = false;
#define TP_INT8_SCALAR
#endif
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
