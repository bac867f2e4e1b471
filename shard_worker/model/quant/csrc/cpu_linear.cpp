// y = x W^T + b on CPU for weights repacked once into row blocks this kernel streams sequentially. Built
// by shard_worker/cpu_ext.py (-O3 -march=native -fopenmp) and called through ctypes; plain C ABI, no torch
// headers.
//
// Weight layouts (N rows padded with zeros to a whole number of blocks):
//   bfloat16: [N / 16][K2 / 2][16][2]   K2 = K rounded up to even (a zero column): one 64-byte line holds
//             16 rows x 2 consecutive k, what one _mm512_dpbf16_ps takes against a broadcast
//             (x[m, k], x[m, k + 1]) pair.
//   float32:  [N / R][K][R]             R = 16 with AVX-512F, 8 otherwise (AVX2 + FMA, or scalar).
//   int8:     [N / 16][K2 / 2][2][16]   with a float32 scale per row: cpu_linear_int8.cpp (and e4m3 bytes).
//   int4:     [N / 16][K / 4][32] bytes  with a scale and offset per group: cpu_linear_int4.cpp.
// tp_linear_rows(dtype) tells the caller R. x [M, K] row-major, float32 or bfloat16: converted to the
// weight's type first where it differs (float32 to bfloat16 rounds to nearest even, as torch does). y
// [M, N] row-major in x's type; bias [N] float32 or bfloat16, or null. Sums in float32; a bfloat16
// weight's product is rounded to bfloat16 before the bias even when y is float32 (x W^T computed in the
// weight's type, as torch's F.linear on x rounded to it would).
// Blocking and the driver: cpu_linear.h.

#include "cpu_linear.h"

namespace {

#if defined(__AVX512F__)
struct F32Kernel : Traits {
  using W = float;
  using X = float;
  static constexpr int ROWS = 16, MB_MAX = 8, MB_BIG = 6, NB_MAX = 4, STEP = 16;
  static int nb_for(int64_t m) { return m == 7 || m == 8 ? 3 : 4; }
  static int64_t steps(int64_t k) { return k; }
  template <int MB, int NB>
  static void tile(const Tile& t) {
    const float* w = static_cast<const float*>(t.w);
    const float* x = static_cast<const float*>(t.x);
    __m512 acc[MB][NB];
    for (int m = 0; m < MB; ++m)
      for (int b = 0; b < NB; ++b)
        acc[m][b] = t.accumulate ? _mm512_loadu_ps(t.acc + m * ACC_LD + b * 16) : _mm512_setzero_ps();
    for (int64_t k = t.s0; k < t.s1; ++k) {
      __m512 wv[NB];
      for (int b = 0; b < NB; ++b) {
        const float* wp = w + b * t.bstride + k * 16;
        _mm_prefetch(reinterpret_cast<const char*>(wp + PREFETCH * 16), _MM_HINT_T0);
        wv[b] = _mm512_loadu_ps(wp);
      }
      for (int m = 0; m < MB; ++m) {
        const __m512 xv = _mm512_set1_ps(x[m * t.ldx + k]);
        for (int b = 0; b < NB; ++b) acc[m][b] = _mm512_fmadd_ps(xv, wv[b], acc[m][b]);
      }
    }
    for (int m = 0; m < MB; ++m)
      for (int b = 0; b < NB; ++b) _mm512_storeu_ps(t.acc + m * ACC_LD + b * 16, acc[m][b]);
  }
};
#elif defined(__AVX2__) && defined(__FMA__)
struct F32Kernel : Traits {  // 16 ymm registers: 4 rows x 3 blocks of accumulators, 3 weights, 1 broadcast
  using W = float;
  using X = float;
  static constexpr int ROWS = 8, MB_MAX = 4, MB_BIG = 4, NB_MAX = 3, STEP = 8;
  static int nb_for(int64_t) { return 3; }
  static int64_t steps(int64_t k) { return k; }
  template <int MB, int NB>
  static void tile(const Tile& t) {
    const float* w = static_cast<const float*>(t.w);
    const float* x = static_cast<const float*>(t.x);
    __m256 acc[MB][NB];
    for (int m = 0; m < MB; ++m)
      for (int b = 0; b < NB; ++b)
        acc[m][b] = t.accumulate ? _mm256_loadu_ps(t.acc + m * ACC_LD + b * 8) : _mm256_setzero_ps();
    for (int64_t k = t.s0; k < t.s1; ++k) {
      __m256 wv[NB];
      for (int b = 0; b < NB; ++b) {
        const float* wp = w + b * t.bstride + k * 8;
        if ((k & 1) == 0) _mm_prefetch(reinterpret_cast<const char*>(wp + PREFETCH * 16), _MM_HINT_T0);
        wv[b] = _mm256_loadu_ps(wp);
      }
      for (int m = 0; m < MB; ++m) {
        const __m256 xv = _mm256_broadcast_ss(x + m * t.ldx + k);
        for (int b = 0; b < NB; ++b) acc[m][b] = _mm256_fmadd_ps(xv, wv[b], acc[m][b]);
      }
    }
    for (int m = 0; m < MB; ++m)
      for (int b = 0; b < NB; ++b) _mm256_storeu_ps(t.acc + m * ACC_LD + b * 8, acc[m][b]);
  }
};
#endif

#if !defined(__AVX512F__) && !(defined(__AVX2__) && defined(__FMA__))
using F32Kernel = ScalarKernel<float, 8>;
constexpr bool F32_NATIVE = false;
#else
constexpr bool F32_NATIVE = true;
#endif

}  // namespace

extern "C" {

// cpu_linear_int8.cpp's half of the library.
void tp_linear_int8_run(int x_dtype, const void* x, void* y, const void* w, const float* scale, int64_t group,
                        int bias_dtype, const void* bias, int64_t m, int64_t n, int64_t k, int threads);
int tp_linear_int8_native();
void tp_linear_w8a8_run(int x_dtype, const void* x, void* y, const void* w, const float* scale, int bias_dtype,
                        const void* bias, int64_t m, int64_t n, int64_t k, int threads);
int tp_linear_w8a8_native();
void tp_linear_fp8_run(int x_dtype, const void* x, void* y, const void* w, const float* scale, int bias_dtype,
                       const void* bias, int64_t m, int64_t n, int64_t k, int threads);
// cpu_linear_int4.cpp's.
void tp_linear_int4_run(int x_dtype, const void* x, void* y, const void* w, const float* scale, int64_t group,
                        int bias_dtype, const void* bias, int64_t m, int64_t n, int64_t k, int threads);
int tp_linear_int4_native();

int tp_linear_abi() { return 7; }

// Rows per block of a weight of this dtype's layout.
int tp_linear_rows(int w_dtype) { return w_dtype == F32 ? F32Kernel::ROWS : 16; }

// Whether this build multiplies weights of this dtype with vector instructions (else plain loops).
int tp_linear_native(int w_dtype) {
  if (w_dtype == W8A8) return tp_linear_w8a8_native();
  if (w_dtype == INT4) return tp_linear_int4_native();
  return w_dtype == BF16 ? BF16_NATIVE : w_dtype == F32 ? F32_NATIVE : tp_linear_int8_native();  // int8, fp8
}

// 0 on success; 1: a dtype code out of range, an int8 weight without its scale, a group that is not
// even or does not divide K and 2048, an int4 weight without groups of a multiple of 8. scale, group:
// int8 (float32 [N] for group 0, else a scale per group of k; W8A8: [2, N]: cpu_linear_int8.cpp) and
// int4 (a scale and an offset per group: cpu_linear_int4.cpp); fp8 (e4m3, a scale per row).
int tp_linear(int x_dtype, int w_dtype, const void* x, void* y, const void* w, const float* scale,
              int64_t group, int bias_dtype, const void* bias, int64_t m, int64_t n, int64_t k, int threads) {
  if ((x_dtype != F32 && x_dtype != BF16) || w_dtype < F32 || w_dtype > FP8) return 1;
  if ((bias && bias_dtype != F32 && bias_dtype != BF16) || (w_dtype >= INT8 && !scale)) return 1;
  if (group && (group < 0 || group % 2 || k % group || 2 * K_CHUNK % group)) return 1;
  if (w_dtype == INT4 && (!group || group % 8)) return 1;
  if (m <= 0 || n <= 0) return 0;
  if (w_dtype == INT4) {
    tp_linear_int4_run(x_dtype, x, y, w, scale, group, bias ? bias_dtype : -1, bias, m, n, k, threads);
    return 0;
  }
  if (w_dtype == INT8) {
    tp_linear_int8_run(x_dtype, x, y, w, scale, group, bias ? bias_dtype : -1, bias, m, n, k, threads);
    return 0;
  }
  if (w_dtype == FP8) {
    if (group) return 1;
    tp_linear_fp8_run(x_dtype, x, y, w, scale, bias ? bias_dtype : -1, bias, m, n, k, threads);
    return 0;
  }
  if (w_dtype == W8A8) {
    tp_linear_w8a8_run(x_dtype, x, y, w, scale, bias ? bias_dtype : -1, bias, m, n, k, threads);
    return 0;
  }
  const Call c{x_dtype, x, y, w, bias ? bias_dtype : -1, bias, nullptr, m, n, k};
  if (w_dtype == BF16)
    run<Bf16Kernel>(c, threads);
  else
    run<F32Kernel>(c, threads);
  return 0;
}

}  // extern "C"
