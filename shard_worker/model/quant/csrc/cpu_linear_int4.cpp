// y = x W^T + b on CPU for a 4-bit weight in groups along K, w[n, k] = q[n, k] * s[n, g] + o[n, g] with
// q in 0..15 and g = k / group (AWQ, GPTQ, compressed-tensors W4A16: o = -zero * s; GGUF's Q4_0 and Q4_K:
// their scale and min), the third part of the library cpu_linear.cpp begins (driver: cpu_linear.h).
//
// A group's sum is s * sum_k x_k q_k + o * sum_k x_k: the kernel sums x q in float32, the driver gives it
// each row's sum of x per group (Tile.xsum, of x as the kernel multiplies it), and the group's scale and
// offset fold both into the running sums. So q is never dequantized: it is widened from its nibble to an
// exact bf16 or float32 in registers.
//
// Layout: 16-row blocks, N padded with zero rows, K / 2 bytes a row, in one of two orders (K a multiple
// of 8; tp_linear_int8_bf16_x() says which: the same condition):
//   AVX-512 BF16 ("lanes"): [N / 16][K / 8][32] 16-bit lanes, lane 2r + i holding row r's k = 8j + 2t + i
//     in its nibble t (bits 4t..4t + 3), t = 0..3: a 64-byte line is 4 steps of (k, k + 1) pairs, and a
//     step's 32 values are one shift and one bit operation away from the bf16 pairs _mm512_dpbf16_ps takes
//     (no shuffle: nibble | 0x4300 is bf16(128 + q), exactly). So the kernel sums x (128 + q) and the fold
//     takes 128 s xsum back off (its offsets o - 128 s); x rounded to bf16 as the int8 kernel rounds it.
//     (A bf16(0..15) table through vpermw measured 1.14x int8 at one row on 8192 x 8192, out of cache;
//     its shuffles, not memory, bounded it.)
//   otherwise ("planes"): [N / 16][K / 4][32] bytes, the 32 bytes of a block holding k = 4j..4j+3 of its 16
//     rows: bytes 0-15 the rows at even k, 16-31 at odd k, the low nibbles k 4j and 4j + 1, the high ones
//     4j + 2 and 4j + 3; widened to float32 and multiplied in float32.
// Scales and offsets: [N / 16][K / g][2][16] float32 (a block's 16 scales of a group, then its 16
// offsets), g a multiple of 8 dividing K and 2048.

#include "cpu_linear.h"

namespace {

struct Int4Traits : Traits {
  using W = uint8_t;
  static constexpr int ROWS = 16, STEP = 16;  // 16 bytes per block per step (two k of 16 rows, 4 bits)
  static constexpr int GSCALES = 2;
  static constexpr bool XSUM = true;
  static int64_t steps(int64_t k) { return (k + 1) / 2; }
};

// Folds a group's sums into the running ones (t.acc; the registers hold the group's): acc += s * part.
#if defined(__AVX512F__)
template <int MB, int NB>
inline void fold(const Tile& t, int64_t g, __m512 (&part)[MB][NB]) {
  for (int b = 0; b < NB; ++b) {
    const __m512 sv = _mm512_loadu_ps(t.gscale + b * t.gstride + g * 32);
    for (int m = 0; m < MB; ++m) {
      float* a = t.acc + m * ACC_LD + b * 16;
      _mm512_storeu_ps(a, _mm512_fmadd_ps(part[m][b], sv, _mm512_loadu_ps(a)));
    }
  }
}

// Then the offsets' share of the steps [s0, s1): acc += (o - bias s) * xsum over their groups, a block at
// a time in registers (cheaper than with each group's fold, through memory: 1.3x at 8 rows in groups of
// 32). bias: what the kernel added to each q (lanes: 128).
template <int MB, int NB, int BIAS = 0>
inline void offsets(const Tile& t) {
  const int64_t gs = t.group / 2;
  for (int b = 0; b < NB; ++b) {
    __m512 acc[MB];
    for (int m = 0; m < MB; ++m) acc[m] = _mm512_loadu_ps(t.acc + m * ACC_LD + b * 16);
    for (int64_t g = t.s0 / gs; g < t.s1 / gs; ++g) {
      const float* so = t.gscale + b * t.gstride + g * 32;
      __m512 ov = _mm512_loadu_ps(so + 16);
      if constexpr (BIAS != 0) ov = _mm512_fnmadd_ps(_mm512_loadu_ps(so), _mm512_set1_ps(BIAS), ov);
      for (int m = 0; m < MB; ++m) acc[m] = _mm512_fmadd_ps(ov, _mm512_set1_ps(t.xsum[m * t.ldxs + g]), acc[m]);
    }
    for (int m = 0; m < MB; ++m) _mm512_storeu_ps(t.acc + m * ACC_LD + b * 16, acc[m]);
  }
}
#endif

inline void zero_acc(const Tile& t, int mb, int cols) {
  if (!t.accumulate)
    for (int m = 0; m < mb; ++m) std::memset(t.acc + m * ACC_LD, 0, sizeof(float) * cols);
}

#if defined(__AVX512BF16__) && defined(__AVX512BW__)
struct Int4Kernel : Int4Traits {
  using X = uint32_t;  // a pair of bf16
  // Registers: MB x NB group sums, MB x NB running sums where they fit (REGS), NB lines and NB widened
  // weights, two constants, a broadcast x. Above 8 rows, wide tiles folding through L1.
  static constexpr int MB_MAX = 8, MB_BIG = 8, NB_MAX = 4;
  static int nb_for(int64_t m) { return m <= 2 ? 4 : m <= 3 ? 3 : m <= 6 ? 2 : 3; }
  template <int MB, int NB>
  static void tile(const Tile& t) {
    const uint8_t* w = static_cast<const uint8_t*>(t.w);
    const int32_t* x = static_cast<const int32_t*>(t.x);
    const __m512i low = _mm512_set1_epi16(0x0f), bf16_128 = _mm512_set1_epi16(0x4300);
    const int64_t gs = t.group / 2;  // steps per group (a multiple of 4)
    constexpr bool REGS = 2 * MB * NB + 2 * NB + 3 <= 32;
    __m512 acc[MB][NB];
    zero_acc(t, MB, NB * 16);
    if constexpr (REGS)
      for (int m = 0; m < MB; ++m)
        for (int b = 0; b < NB; ++b) acc[m][b] = _mm512_loadu_ps(t.acc + m * ACC_LD + b * 16);
    for (int64_t p0 = t.s0; p0 < t.s1; p0 += gs) {
      __m512 part[MB][NB];
      for (int m = 0; m < MB; ++m)
        for (int b = 0; b < NB; ++b) part[m][b] = _mm512_setzero_ps();
      for (int64_t p = p0; p < p0 + gs; p += 4) {
        __m512i line[NB];
        for (int b = 0; b < NB; ++b) {
          const uint8_t* wp = w + b * t.bstride + p * 16;
          _mm_prefetch(reinterpret_cast<const char*>(wp) + PREFETCH * 64, _MM_HINT_T0);
          line[b] = _mm512_loadu_si512(wp);
        }
        for (int i = 0; i < 4; ++i) {  // step p + i: nibble i of each lane; (nibble & 0xf) | 0x4300
          __m512bh wv[NB];
          for (int b = 0; b < NB; ++b)
            wv[b] = (__m512bh)_mm512_ternarylogic_epi32(_mm512_srli_epi16(line[b], 4 * i), low, bf16_128, 0xea);
          for (int m = 0; m < MB; ++m) {
            const __m512bh xv = (__m512bh)_mm512_set1_epi32(x[m * t.ldx + p + i]);
            for (int b = 0; b < NB; ++b) part[m][b] = _mm512_dpbf16_ps(part[m][b], xv, wv[b]);
          }
        }
      }
      if constexpr (REGS) {
        for (int b = 0; b < NB; ++b) {
          const __m512 sv = _mm512_loadu_ps(t.gscale + b * t.gstride + p0 / gs * 32);
          for (int m = 0; m < MB; ++m) acc[m][b] = _mm512_fmadd_ps(part[m][b], sv, acc[m][b]);
        }
      } else {
        fold<MB, NB>(t, p0 / gs, part);
      }
    }
    if constexpr (REGS)
      for (int m = 0; m < MB; ++m)
        for (int b = 0; b < NB; ++b) _mm512_storeu_ps(t.acc + m * ACC_LD + b * 16, acc[m][b]);
    offsets<MB, NB, 128>(t);
  }
};

#elif defined(__AVX512F__)
struct Int4Kernel : Int4Traits {
  using X = float;
  static constexpr bool PAIRED = true;
  static constexpr int MB_MAX = 8, MB_BIG = 8, NB_MAX = 4;
  static int nb_for(int64_t m) { return m <= 4 ? 4 : 2; }
  template <int MB, int NB>
  static void tile(const Tile& t) {
    const uint8_t* w = static_cast<const uint8_t*>(t.w);
    const float* x = static_cast<const float*>(t.x);
    const __m512i low = _mm512_set1_epi32(0x0f);
    const int64_t gs = t.group / 2;
    zero_acc(t, MB, NB * 16);
    for (int64_t p0 = t.s0; p0 < t.s1; p0 += gs) {
      __m512 part[MB][NB];
      for (int m = 0; m < MB; ++m)
        for (int b = 0; b < NB; ++b) part[m][b] = _mm512_setzero_ps();
      for (int64_t p = p0; p < p0 + gs; p += 2) {
        __m512i e[NB], o[NB];  // the bytes of k (2p, 2p + 2) and (2p + 1, 2p + 3), a row each
        for (int b = 0; b < NB; ++b) {
          const uint8_t* wp = w + b * t.bstride + p * 16;
          if ((p & 2) == 0) _mm_prefetch(reinterpret_cast<const char*>(wp) + 512, _MM_HINT_T0);
          e[b] = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(wp)));
          o[b] = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(wp + 16)));
        }
        for (int j = 0; j < 4; ++j) {  // k = 2p + j
          __m512 wv[NB];
          for (int b = 0; b < NB; ++b) {
            const __m512i v = j & 1 ? o[b] : e[b];
            wv[b] = _mm512_cvtepi32_ps(j < 2 ? _mm512_and_si512(v, low) : _mm512_srli_epi32(v, 4));
          }
          for (int m = 0; m < MB; ++m) {
            const __m512 xv = _mm512_set1_ps(x[m * t.ldx + 2 * p + j]);
            for (int b = 0; b < NB; ++b) part[m][b] = _mm512_fmadd_ps(xv, wv[b], part[m][b]);
          }
        }
      }
      fold<MB, NB>(t, p0 / gs, part);
    }
    offsets<MB, NB>(t);
  }
};

#elif defined(__AVX2__) && defined(__FMA__)
struct Int4Kernel : Int4Traits {  // 16 ymm: 4 rows x 2 halves of sums, 4 byte vectors, a weight, an x
  using X = float;
  static constexpr bool PAIRED = true;
  static constexpr int MB_MAX = 4, MB_BIG = 4, NB_MAX = 1;
  static int nb_for(int64_t) { return 1; }
  template <int MB, int NB>
  static void tile(const Tile& t) {
    const uint8_t* w = static_cast<const uint8_t*>(t.w);
    const float* x = static_cast<const float*>(t.x);
    const __m256i low = _mm256_set1_epi32(0x0f);
    const int64_t gs = t.group / 2;
    zero_acc(t, MB, 16);
    for (int64_t p0 = t.s0; p0 < t.s1; p0 += gs) {
      __m256 part[MB][2];
      for (int m = 0; m < MB; ++m) part[m][0] = part[m][1] = _mm256_setzero_ps();
      for (int64_t p = p0; p < p0 + gs; p += 2) {
        const uint8_t* wp = w + p * 16;
        if ((p & 2) == 0) _mm_prefetch(reinterpret_cast<const char*>(wp) + 512, _MM_HINT_T0);
        __m256i bytes[4];  // rows 0-7 at even k, rows 8-15; then at odd k
        for (int i = 0; i < 4; ++i)
          bytes[i] = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(wp + 8 * i)));
        for (int j = 0; j < 4; ++j)  // k = 2p + j
          for (int hr = 0; hr < 2; ++hr) {
            const __m256i v = bytes[(j & 1) * 2 + hr];
            const __m256 wv = _mm256_cvtepi32_ps(j < 2 ? _mm256_and_si256(v, low) : _mm256_srli_epi32(v, 4));
            for (int m = 0; m < MB; ++m)
              part[m][hr] = _mm256_fmadd_ps(_mm256_broadcast_ss(x + m * t.ldx + 2 * p + j), wv, part[m][hr]);
          }
      }
      const int64_t g = p0 / gs;
      for (int hr = 0; hr < 2; ++hr) {
        const float* so = t.gscale + g * 32 + hr * 8;
        const __m256 sv = _mm256_loadu_ps(so), ov = _mm256_loadu_ps(so + 16);
        for (int m = 0; m < MB; ++m) {
          float* a = t.acc + m * ACC_LD + hr * 8;
          const __m256 xs = _mm256_broadcast_ss(t.xsum + m * t.ldxs + g);
          _mm256_storeu_ps(a, _mm256_fmadd_ps(ov, xs, _mm256_fmadd_ps(part[m][hr], sv, _mm256_loadu_ps(a))));
        }
      }
    }
  }
};

#else
struct Int4Kernel : Int4Traits {  // any CPU: plain loops over the planes layout
  using X = float;
  static constexpr bool PAIRED = true;
  static constexpr int MB_MAX = 4, MB_BIG = 4, NB_MAX = 4;
  static int nb_for(int64_t) { return NB_MAX; }
  template <int MB, int NB>
  static void tile(const Tile& t) {
    const uint8_t* w = static_cast<const uint8_t*>(t.w);
    const float* x = static_cast<const float*>(t.x);
    const int64_t gs = t.group / 2;
    zero_acc(t, MB, NB * 16);
    for (int m = 0; m < MB; ++m)
      for (int j = 0; j < NB * 16; ++j) {
        const uint8_t* wb = w + (j / 16) * t.bstride + j % 16;
        const float* so = t.gscale + (j / 16) * t.gstride + j % 16;
        for (int64_t p0 = t.s0; p0 < t.s1; p0 += gs) {
          float part = 0.0f;
          for (int64_t p = p0; p < p0 + gs; ++p)  // step p: k 2p, 2p + 1; its nibble: p's parity
            for (int i = 0; i < 2; ++i) {
              const int q = (wb[(p & ~int64_t{1}) * 16 + 16 * i] >> (4 * (p & 1))) & 15;
              part += x[m * t.ldx + 2 * p + i] * static_cast<float>(q);
            }
          const int64_t g = p0 / gs;
          float& a = t.acc[m * ACC_LD + j];
          a = so[g * 32 + 16] * t.xsum[m * t.ldxs + g] + (part * so[g * 32] + a);
        }
      }
  }
};
#define TP_INT4_SCALAR
#endif

}  // namespace

extern "C" {

// scale: [N / 16][K / group][2][16] float32 (scales, then offsets); group a multiple of 8 dividing K and
// 2048 (the caller checks).
void tp_linear_int4_run(int x_dtype, const void* x, void* y, const void* w, const float* scale, int64_t group,
                        int bias_dtype, const void* bias, int64_t m, int64_t n, int64_t k, int threads) {
  run<Int4Kernel>(Call{x_dtype, x, y, w, bias_dtype, bias, nullptr, m, n, k, scale, group}, threads);
}

#if defined(TP_INT4_SCALAR)
int tp_linear_int4_native() { return 0; }
#else
int tp_linear_int4_native() { return 1; }
#endif

}  // extern "C"
