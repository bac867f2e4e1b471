// The driver shared by the CPU linear kernels (cpu_linear.cpp: float32 and bfloat16 weights;
// cpu_linear_int8.cpp: int8 weights with float32 scales per output row or group; cpu_linear_int4.cpp: 4-bit
// weights with a scale and offset per group), compiled into one
// library by shard_worker/cpu_ext.py. A kernel is a struct with a tile<MB, NB>() over its layout and its
// traits (Traits below); run<Kernel>() blocks the product around it.
//
// Blocking: a tile is NB row blocks (the accumulators of MB input rows x NB blocks fill the vector
// registers); for up to MB_MAX input rows one pass reads each weight byte once. Above that, input rows go
// in chunks over a tile's weights split along K so the piece re-read per chunk stays in L2, and rows are
// cut in groups so that both threads get work on narrow layers. OpenMP over (tile, row group),
// static blocks: a thread's consecutive items share a tile.
//
// The kernels' building blocks (Tile, Traits, the bf16 and plain-loop kernels) are in cpu_linear_tiles.h.

#pragma once

#include <omp.h>

#include <algorithm>
#include <cstdint>
#include <vector>

#include "cpu_linear_tiles.h"

namespace {

template <class Kern, int MB, int NB>
void call_tile(const Tile& t) {
  if constexpr (MB <= Kern::MB_MAX && NB <= Kern::NB_MAX) Kern::template tile<MB, NB>(t);
}

template <class Kern, int MB>
void by_nb(int nb, const Tile& t) {
  switch (nb) {
    case 1: return call_tile<Kern, MB, 1>(t);
    case 2: return call_tile<Kern, MB, 2>(t);
    case 3: return call_tile<Kern, MB, 3>(t);
    case 4: return call_tile<Kern, MB, 4>(t);
  }
}

template <class Kern>
void by_mb(int mb, int nb, const Tile& t) {
  switch (mb) {
    case 1: return by_nb<Kern, 1>(nb, t);
    case 2: return by_nb<Kern, 2>(nb, t);
    case 3: return by_nb<Kern, 3>(nb, t);
    case 4: return by_nb<Kern, 4>(nb, t);
    case 5: return by_nb<Kern, 5>(nb, t);
    case 6: return by_nb<Kern, 6>(nb, t);
    case 7: return by_nb<Kern, 7>(nb, t);
    case 8: return by_nb<Kern, 8>(nb, t);
  }
}

struct Call {
  int x_dtype;
  const void* x;
  void* y;
  const void* w;
  int bias_dtype;  // -1: none
  const void* bias;
  const float* scale;  // [N], multiplies each output's sum before the bias; null: none
  int64_t m, n, k;
  const float* gscale = nullptr;  // or a scale per group of `group` k (Tile.gscale's layout)
  int64_t group = 0;
};

// A tile's sums for one input row (cols of them) plus the bias, written in y's type. round: float32
// output of a bfloat16 product, rounded to bfloat16 before the bias (the product in the weight's type, as
// unquantized.linear computes it with F.linear).
void emit(const float* a, const float* bias, bool bf16_out, bool round, void* y, int64_t cols) {
  if (bf16_out) {
    uint16_t* out = static_cast<uint16_t*>(y);
    if (bias) {
#pragma omp simd
      for (int64_t j = 0; j < cols; ++j) out[j] = f32_to_bf16(a[j] + bias[j]);
    } else {
#pragma omp simd
      for (int64_t j = 0; j < cols; ++j) out[j] = f32_to_bf16(a[j]);
    }
  } else {
    float* out = static_cast<float*>(y);
    if (round) {
#pragma omp simd
      for (int64_t j = 0; j < cols; ++j) out[j] = bf16_to_f32(f32_to_bf16(a[j])) + (bias ? bias[j] : 0.0f);
    } else if (bias) {
#pragma omp simd
      for (int64_t j = 0; j < cols; ++j) out[j] = a[j] + bias[j];
    } else {
      std::memcpy(out, a, sizeof(float) * cols);
    }
  }
}

// x as the kernel's input elements, row stride ldx (in X units): x itself where it already is.
template <class Kern>
const typename Kern::X* kernel_input(const Call& c, std::vector<typename Kern::X>& buf, int64_t& ldx) {
  using X = typename Kern::X;
  if constexpr (std::is_same<X, uint32_t>::value) {  // bf16 pairs
    ldx = (c.k + 1) / 2;
    if (c.x_dtype == BF16 && c.k % 2 == 0) return static_cast<const X*>(c.x);
    buf.assign(c.m * ldx, 0);
    uint16_t* dst = reinterpret_cast<uint16_t*>(buf.data());
    for (int64_t i = 0; i < c.m; ++i)
      for (int64_t j = 0; j < c.k; ++j)
        dst[i * 2 * ldx + j] = c.x_dtype == BF16
                                   ? static_cast<const uint16_t*>(c.x)[i * c.k + j]
                                   : f32_to_bf16(static_cast<const float*>(c.x)[i * c.k + j]);
    return buf.data();
  } else {  // float32, rows padded to even K for a PAIRED kernel
    ldx = Kern::PAIRED ? c.k + c.k % 2 : c.k;
    if (c.x_dtype == F32 && ldx == c.k) return static_cast<const X*>(c.x);
    buf.assign(c.m * ldx, 0.0f);
    for (int64_t i = 0; i < c.m; ++i)
      for (int64_t j = 0; j < c.k; ++j)
        buf[i * ldx + j] = c.x_dtype == F32 ? static_cast<const float*>(c.x)[i * c.k + j]
                                            : bf16_to_f32(static_cast<const uint16_t*>(c.x)[i * c.k + j]);
    return buf.data();
  }
}

// W8A8's x: each row quantized by its own absmax (scale absmax / 127, round half to even, clamp to
// +-127: kernels.PackedInt8.matmul_dynamic's rule, in the same float32 operations), plus 128 as the
// unsigned bytes _mm512_dpbusd_epi32 takes, four k a 32-bit word (padding k: 128, a zero x).
inline const uint32_t* quantized_input(const Call& c, std::vector<uint32_t>& buf, int64_t& ldx,
                                       std::vector<float>& xscale) {
  ldx = (c.k + 3) / 4;
  buf.assign(c.m * ldx, 0x80808080u);
  xscale.resize(c.m);
  std::vector<float> row(c.k);
  for (int64_t i = 0; i < c.m; ++i) {
    if (c.x_dtype == F32)
      std::memcpy(row.data(), static_cast<const float*>(c.x) + i * c.k, 4 * c.k);
    else
      for (int64_t j = 0; j < c.k; ++j) row[j] = bf16_to_f32(static_cast<const uint16_t*>(c.x)[i * c.k + j]);
    float amax = 0.0f;
    int64_t j0 = 0;
#if defined(__AVX512F__)
    __m512 vmax = _mm512_setzero_ps();
    for (; j0 + 16 <= c.k; j0 += 16) vmax = _mm512_max_ps(vmax, _mm512_abs_ps(_mm512_loadu_ps(&row[j0])));
    amax = _mm512_reduce_max_ps(vmax);
#endif
    for (int64_t j = j0; j < c.k; ++j) amax = std::max(amax, std::fabs(row[j]));
    const float s = std::max(amax, FLT_MIN) / 127.0f;
    xscale[i] = s;
    uint8_t* dst = reinterpret_cast<uint8_t*>(buf.data() + i * ldx);
    int64_t j = 0;
#if defined(__AVX512F__)
    const __m512 sv = _mm512_set1_ps(s), lo = _mm512_set1_ps(-127.0f), hi = _mm512_set1_ps(127.0f);
    for (; j + 16 <= c.k; j += 16) {
      __m512 q = _mm512_roundscale_ps(_mm512_div_ps(_mm512_loadu_ps(&row[j]), sv), _MM_FROUND_TO_NEAREST_INT);
      q = _mm512_add_ps(_mm512_min_ps(hi, _mm512_max_ps(lo, q)), _mm512_set1_ps(128.0f));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + j), _mm512_cvtepi32_epi8(_mm512_cvtps_epi32(q)));
    }
#endif
    for (; j < c.k; ++j)
      dst[j] = static_cast<uint8_t>(std::min(127.0f, std::max(-127.0f, std::nearbyint(row[j] / s))) + 128.0f);
  }
  return buf.data();
}

template <class Kern>
void run(const Call& c, int threads) {
  using X = typename Kern::X;
  using W = typename Kern::W;
  std::vector<X> xbuf;
  int64_t ldx = 0;
  std::vector<float> xscale;  // W8A8: each row's scale
  const X* x;
  if constexpr (Kern::QUADS)
    x = quantized_input(c, xbuf, ldx, xscale);
  else
    x = kernel_input<Kern>(c, xbuf, ldx);
  std::vector<float> xsum;  // XSUM: [m][K / group], x as the kernel multiplies it
  const int64_t ngroups = c.group ? c.k / c.group : 0;
  if constexpr (Kern::XSUM) {  // 16 running sums a group (vectorized), then added up
    xsum.resize(c.m * ngroups);
    std::vector<float> row(c.k);
    for (int64_t i = 0; i < c.m; ++i) {
      if constexpr (std::is_same<X, uint32_t>::value) {
        const uint16_t* xi = reinterpret_cast<const uint16_t*>(x + i * ldx);
#pragma omp simd
        for (int64_t j = 0; j < c.k; ++j) row[j] = bf16_to_f32(xi[j]);
      } else {
        std::memcpy(row.data(), x + i * ldx, 4 * c.k);
      }
      for (int64_t g = 0; g < ngroups; ++g) {
        const float* r = row.data() + g * c.group;
        float lanes[16] = {}, sum = 0.0f;
        int64_t j = 0;
        for (; j + 16 <= c.group; j += 16)
#pragma omp simd
          for (int l = 0; l < 16; ++l) lanes[l] += r[j + l];
        for (; j < c.group; ++j) sum += r[j];
        for (int l = 0; l < 16; ++l) sum += lanes[l];
        xsum[i * ngroups + g] = sum;
      }
    }
  }
  std::vector<float> bias;
  if (c.bias_dtype == F32) {
    bias.assign(static_cast<const float*>(c.bias), static_cast<const float*>(c.bias) + c.n);
  } else if (c.bias_dtype == BF16) {
    bias.resize(c.n);
    for (int64_t j = 0; j < c.n; ++j) bias[j] = bf16_to_f32(static_cast<const uint16_t*>(c.bias)[j]);
  }
  const int64_t steps = Kern::steps(c.k);
  const int64_t bstride = steps * Kern::STEP;
  const int64_t blocks = (c.n + Kern::ROWS - 1) / Kern::ROWS;
  const bool one_chunk = c.m <= Kern::MB_MAX;
  const int64_t piece = one_chunk ? steps : K_CHUNK;
  // Rows in groups of at most ROW_GROUP, of near-equal sizes (50 rows: 25 + 25, not 48 + 2).
  const int64_t groups = one_chunk ? 1 : (c.m + ROW_GROUP - 1) / ROW_GROUP;
  const int64_t group = (c.m + groups - 1) / groups;
  // Narrower tiles where wide ones would leave threads idle or unevenly loaded (a narrow layer).
  int nb_tile = Kern::nb_for(c.m);
  while (threads > 1 && nb_tile > 1 && (blocks + nb_tile - 1) / nb_tile * groups < 4 * threads) --nb_tile;
  const int64_t tiles = (blocks + nb_tile - 1) / nb_tile;
  const int64_t items = tiles * groups;
  const bool round = c.x_dtype == F32 && Kern::ROUND;

  auto work = [&](int64_t item, std::vector<float>& acc) {
    const int64_t tile = item / groups, g0 = (item % groups) * group;
    const int64_t rows = std::min(group, c.m - g0);
    // The group's rows in chunks that fill the registers, of near-equal sizes (16: 6 + 5 + 5).
    const int64_t chunks = one_chunk ? 1 : (rows + Kern::MB_BIG - 1) / Kern::MB_BIG;
    const int64_t b0 = tile * nb_tile;
    const int nb = static_cast<int>(std::min<int64_t>(nb_tile, blocks - b0));
    acc.resize(rows * ACC_LD);
    Tile t{static_cast<const W*>(c.w) + b0 * bstride, bstride, 0, 0, nullptr, ldx, nullptr, false};
    if (c.gscale) {
      t.group = c.group;
      t.gstride = ngroups * Kern::ROWS * Kern::GSCALES;
      t.ldxs = ngroups;
      t.gscale = c.gscale + b0 * t.gstride;
    }
    for (int64_t s0 = 0; s0 < steps; s0 += piece) {
      t.s0 = s0;
      t.s1 = std::min(steps, s0 + piece);
      t.accumulate = s0 > 0;
      for (int64_t i = 0, m0 = 0; i < chunks; ++i) {
        const int64_t mb = (rows - m0) / (chunks - i) + ((rows - m0) % (chunks - i) ? 1 : 0);
        t.x = x + (g0 + m0) * ldx;
        if constexpr (Kern::XSUM) t.xsum = xsum.data() + (g0 + m0) * ngroups;
        t.acc = acc.data() + m0 * ACC_LD;
        by_mb<Kern>(static_cast<int>(mb), nb, t);
        m0 += mb;
      }
    }
    const int64_t n0 = b0 * Kern::ROWS;
    const int64_t cols = std::min<int64_t>(nb * Kern::ROWS, c.n - n0);
    const size_t elem = c.x_dtype == F32 ? 4 : 2;
    if constexpr (Kern::QUADS)  // sums of (x_q + 128) q: less 128 sum_k q (scale[N + n]), times x's scale
      for (int64_t m = 0; m < rows; ++m) {
        float* a = acc.data() + m * ACC_LD;
        const float* wsum = c.scale + c.n + n0;
        int64_t j = 0;
#if defined(__AVX512F__)
        const __m512 xs = _mm512_set1_ps(xscale[g0 + m]);
        for (; j + 16 <= cols; j += 16) {
          const __m512i fix = _mm512_slli_epi32(_mm512_cvtps_epi32(_mm512_loadu_ps(wsum + j)), 7);
          const __m512i sum = _mm512_sub_epi32(_mm512_loadu_si512(a + j), fix);
          _mm512_storeu_ps(a + j, _mm512_mul_ps(_mm512_cvtepi32_ps(sum), xs));
        }
#endif
        for (; j < cols; ++j) {
          int32_t sum;
          std::memcpy(&sum, a + j, 4);
          a[j] = static_cast<float>(sum - 128 * static_cast<int32_t>(wsum[j])) * xscale[g0 + m];
        }
      }
    if (c.scale)
      for (int64_t m = 0; m < rows; ++m) {
        float* a = acc.data() + m * ACC_LD;
#pragma omp simd
        for (int64_t j = 0; j < cols; ++j) a[j] *= c.scale[n0 + j];
      }
    for (int64_t m = 0; m < rows; ++m)
      emit(acc.data() + m * ACC_LD, bias.empty() ? nullptr : bias.data() + n0, c.x_dtype == BF16, round,
           static_cast<char*>(c.y) + ((g0 + m) * c.n + n0) * elem, cols);
  };

  if (threads <= 1 || items == 1) {
    std::vector<float> acc;
    for (int64_t i = 0; i < items; ++i) work(i, acc);
    return;
  }
#pragma omp parallel num_threads(threads)
  {
    std::vector<float> acc;
#pragma omp for schedule(static)
    for (int64_t i = 0; i < items; ++i) work(i, acc);
  }
}

}  // namespace
