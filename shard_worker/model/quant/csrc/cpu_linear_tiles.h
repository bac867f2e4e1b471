// What a CPU linear kernel is, for the driver in cpu_linear.h: the layouts' shared constants and bf16
// conversions, a Tile (one block of weights against up to MB_MAX input rows), the Traits a kernel may
// override, and the kernels every layout has: the AVX-512 BF16 tile over bf16 pairs (shared by the bf16
// and int8 kernels) and the plain-loop kernels any CPU runs. The int8 and int4 kernels live in their own
// sources (cpu_linear_int8.cpp, cpu_linear_int4.cpp); shard_worker/cpu_ext.py compiles all of them into
// one library.

#pragma once

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <cfloat>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>

namespace {

enum Dtype { F32 = 0, BF16 = 1, INT8 = 2, W8A8 = 3, INT4 = 4, FP8 = 5 };  // W8A8: int8 weights, x int8 per row

constexpr int ACC_LD = 64;       // floats per accumulator row: up to 4 blocks of 16
constexpr int64_t K_CHUNK = 1024;  // k steps per piece when rows come in several chunks
constexpr int ROW_GROUP = 48;      // at most this many input rows per work item
constexpr int PREFETCH = 8;        // k steps ahead (lines of a block's stream)

inline float bf16_to_f32(uint16_t h) {
  uint32_t bits = static_cast<uint32_t>(h) << 16;
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

inline uint16_t f32_to_bf16(float f) {  // round to nearest even, as torch rounds; branch-free (vectorizes)
  uint32_t bits;
  std::memcpy(&bits, &f, 4);
  const uint32_t rounded = (bits + 0x7fff + ((bits >> 16) & 1)) >> 16;
  const uint32_t nan = (bits >> 16) | 0x40;
  return static_cast<uint16_t>((bits & 0x7fffffff) > 0x7f800000 ? nan : rounded);
}

// One tile's product over k steps [s0, s1) for MB input rows: acc[m * ACC_LD + j] (+)= sum over the
// steps. w: the tile's first block; bstride: elements from one block to the next; x: the chunk's first
// row, ldx elements (bf16: 32-bit pairs) per row.
struct Tile {
  const void* w;
  int64_t bstride;
  int64_t s0, s1;
  const void* x;
  int64_t ldx;
  float* acc;
  bool accumulate;
  // A weight in groups along K: its scales [blocks][K / group][GSCALES][16] from the tile's first block.
  const float* gscale = nullptr;
  int64_t gstride = 0, group = 0;
  // XSUM: each of the chunk's rows' sums of x per group, ldxs (K / group) a row.
  const float* xsum = nullptr;
  int64_t ldxs = 0;
};

// What a kernel may override. STEP: weight elements per block per k step (a step: one k, or a pair of
// them when x comes as bf16 pairs, X = uint32_t, or PAIRED); ROUND: a float32 output is the product
// rounded to bf16 (a bf16 weight's product); QUADS: x quantized per row to int8 (quantized_input), four k
// a step, int32 sums (stored as their bits in the float accumulators); GSCALES: float32 vectors of 16 per
// block and group (int4: a scale and an offset); XSUM: the kernel wants x's sums per group (Tile.xsum).
struct Traits {
  static constexpr bool PAIRED = false, ROUND = false, QUADS = false, XSUM = false;
  static constexpr int GSCALES = 1;
};

#if defined(__AVX512BF16__)
// The steps [p0, p1) of a tile whose weights K::pairs gives as bf16 pairs (16 rows x 2 k a step: a bf16
// weight's own bits, or int8 widened exactly), summed into acc by _mm512_dpbf16_ps. Shared by the bf16 and
// int8 kernels (and the grouped int8 one, a group at a time); inlined, so acc stays in registers.
template <class K, int MB, int NB>
__attribute__((always_inline)) inline void dpbf16_steps(const Tile& t, int64_t p0, int64_t p1,
                                                        __m512 (&acc)[MB][NB]) {
  const typename K::W* w = static_cast<const typename K::W*>(t.w);
  const int32_t* x = static_cast<const int32_t*>(t.x);
  for (int64_t p = p0; p < p1; ++p) {
    __m512bh wv[NB];
    for (int b = 0; b < NB; ++b) {
      const typename K::W* wp = w + b * t.bstride + p * 32;
      _mm_prefetch(reinterpret_cast<const char*>(wp) + PREFETCH * 64, _MM_HINT_T0);
      wv[b] = K::pairs(wp);
    }
    for (int m = 0; m < MB; ++m) {
      const __m512bh xv = (__m512bh)_mm512_set1_epi32(x[m * t.ldx + p]);
      for (int b = 0; b < NB; ++b) acc[m][b] = _mm512_dpbf16_ps(acc[m][b], xv, wv[b]);
    }
  }
}

// A whole tile of such a kernel: acc from t.acc (or zero), the steps, back to t.acc.
template <class K, int MB, int NB>
inline void dpbf16_tile(const Tile& t) {
  __m512 acc[MB][NB];
  for (int m = 0; m < MB; ++m)
    for (int b = 0; b < NB; ++b)
      acc[m][b] = t.accumulate ? _mm512_loadu_ps(t.acc + m * ACC_LD + b * 16) : _mm512_setzero_ps();
  dpbf16_steps<K, MB, NB>(t, t.s0, t.s1, acc);
  for (int m = 0; m < MB; ++m)
    for (int b = 0; b < NB; ++b) _mm512_storeu_ps(t.acc + m * ACC_LD + b * 16, acc[m][b]);
}

struct Bf16Kernel : Traits {
  using W = uint16_t;
  using X = uint32_t;  // a pair of bf16
  static constexpr int ROWS = 16, MB_MAX = 8, MB_BIG = 6, NB_MAX = 4, STEP = 32;
  static constexpr bool ROUND = true;
  static int nb_for(int64_t m) { return m == 7 || m == 8 ? 3 : 4; }
  static int64_t steps(int64_t k) { return (k + 1) / 2; }
  static __m512bh pairs(const uint16_t* wp) { return (__m512bh)_mm512_loadu_si512(wp); }
  template <int MB, int NB>
  static void tile(const Tile& t) {
    dpbf16_tile<Bf16Kernel, MB, NB>(t);
  }
};
#endif

// Any CPU: the same layouts in plain loops (the bf16 one when the CPU lacks AVX512_BF16, float32 when it
// lacks AVX2 + FMA). The caller prefers oneDNN over these; they exist so that the layouts are always
// served and testable.
template <typename WT, int R>
struct ScalarKernel : Traits {
  using W = WT;
  using X = typename std::conditional<std::is_same<WT, uint16_t>::value, uint32_t, float>::type;
  static constexpr bool PAIRS = std::is_same<WT, uint16_t>::value, ROUND = PAIRS;
  static constexpr int ROWS = R, MB_MAX = 4, MB_BIG = 4, NB_MAX = 4, STEP = PAIRS ? 2 * R : R;
  static int nb_for(int64_t) { return NB_MAX; }
  static int64_t steps(int64_t k) { return PAIRS ? (k + 1) / 2 : k; }
  template <int MB, int NB>
  static void tile(const Tile& t) {
    const WT* w = static_cast<const WT*>(t.w);
    const X* x = static_cast<const X*>(t.x);
    for (int m = 0; m < MB; ++m)
      for (int j = 0; j < NB * R; ++j) {
        float a = t.accumulate ? t.acc[m * ACC_LD + j] : 0.0f;
        const WT* wb = w + (j / R) * t.bstride;
        const int r = j % R;
        for (int64_t s = t.s0; s < t.s1; ++s) {
          if constexpr (PAIRS) {
            const uint32_t xp = x[m * t.ldx + s];
            a += bf16_to_f32(xp & 0xffff) * bf16_to_f32(wb[s * 2 * R + 2 * r]);
            a += bf16_to_f32(xp >> 16) * bf16_to_f32(wb[s * 2 * R + 2 * r + 1]);
          } else {
            a += x[m * t.ldx + s] * wb[s * R + r];
          }
        }
        t.acc[m * ACC_LD + j] = a;
      }
  }
};

#if !defined(__AVX512BF16__)
using Bf16Kernel = ScalarKernel<uint16_t, 16>;
constexpr bool BF16_NATIVE = false;
#else
constexpr bool BF16_NATIVE = true;
#endif

}  // namespace
