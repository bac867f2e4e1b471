// Paged attention for CPU: each selected query token attended over its sequence's keys, read in place
// from the paged KV cache through the block table (nothing gathered), in float32 arithmetic whatever the
// element types. Built by shard_worker/cpu_ext.py with -O3 -march=native -fopenmp and called through
// ctypes; plain C ABI, no torch headers (the build takes about a second, where a torch extension takes a minute).
//
// Layouts (element strides given by the caller, last dimension contiguous):
//   q, out:   [T, H, D]   rows picked by `tokens` (n of them); out in q's element type
//   k, v:     [num_blocks, block_size, KVH, D]
//   table:    [S, table_stride] int32 physical block ids
// Token i (step row tokens[i]) belongs to sequence seq[i] and sits at position pos[i]; it sees the keys at
// positions max(0, pos - window + 1) .. pos (window <= 0: from 0), its own included: the caller has
// written this step's keys and values before calling.
//
// One work item is a token's query heads of one or all of its KV heads: the heads that share a KV head
// share every key and value row read.
// Scores for the whole visible context are computed first (one pass over the keys), then softmax, then
// one pass over the values. The scores buffer is per thread and grows to the longest context seen.

#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include <omp.h>

namespace {

enum Dtype { F32 = 0, BF16 = 1, F16 = 2, E4M3 = 3, E5M2 = 4 };

float e4m3_table[256];
float e5m2_table[256];

float decode_fp8(uint8_t b, int exp_bits, int bias, bool fn) {
  const int man_bits = 7 - exp_bits;
  const int sign = b >> 7;
  const int e = (b >> man_bits) & ((1 << exp_bits) - 1);
  const int m = b & ((1 << man_bits) - 1);
  float v;
  if (fn && e == (1 << exp_bits) - 1 && m == (1 << man_bits) - 1) {
    v = NAN;  // e4m3fn: only S.1111.111 is NaN, no infinities
  } else if (!fn && e == (1 << exp_bits) - 1) {
    v = m ? NAN : INFINITY;  // e5m2 follows IEEE
  } else if (e == 0) {
    v = std::ldexp(static_cast<float>(m), 1 - bias - man_bits);
  } else {
    v = std::ldexp(1.0f + static_cast<float>(m) / (1 << man_bits), e - bias);
  }
  return sign ? -v : v;
}

struct Tables {
  Tables() {
    for (int i = 0; i < 256; ++i) {
      e4m3_table[i] = decode_fp8(static_cast<uint8_t>(i), 4, 7, true);
      e5m2_table[i] = decode_fp8(static_cast<uint8_t>(i), 5, 15, false);
    }
  }
} tables;

inline float bf16_to_f32(uint16_t h) {
  uint32_t bits = static_cast<uint32_t>(h) << 16;
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

inline uint16_t f32_to_bf16(float f) {  // round to nearest even, as torch rounds
  uint32_t bits;
  std::memcpy(&bits, &f, 4);
  if ((bits & 0x7fffffff) > 0x7f800000) return static_cast<uint16_t>((bits >> 16) | 0x40);  // NaN
  bits += 0x7fff + ((bits >> 16) & 1);
  return static_cast<uint16_t>(bits >> 16);
}

// One row of d elements of type `dtype` at p, as float32 in dst.
inline void load_row(const void* p, int dtype, int d, float* dst) {
  switch (dtype) {
    case F32:
      std::memcpy(dst, p, sizeof(float) * d);
      break;
    case BF16: {
      const uint16_t* s = static_cast<const uint16_t*>(p);
#pragma omp simd
      for (int i = 0; i < d; ++i) dst[i] = bf16_to_f32(s[i]);
      break;
    }
    case F16: {
      const _Float16* s = static_cast<const _Float16*>(p);
#pragma omp simd
      for (int i = 0; i < d; ++i) dst[i] = static_cast<float>(s[i]);
      break;
    }
    case E4M3: {
      const uint8_t* s = static_cast<const uint8_t*>(p);
      for (int i = 0; i < d; ++i) dst[i] = e4m3_table[s[i]];
      break;
    }
    default: {
      const uint8_t* s = static_cast<const uint8_t*>(p);
      for (int i = 0; i < d; ++i) dst[i] = e5m2_table[s[i]];
      break;
    }
  }
}

inline void store_row(const float* src, int dtype, int d, void* p) {
  switch (dtype) {
    case F32:
      std::memcpy(p, src, sizeof(float) * d);
      break;
    case BF16: {
      uint16_t* s = static_cast<uint16_t*>(p);
      for (int i = 0; i < d; ++i) s[i] = f32_to_bf16(src[i]);
      break;
    }
    default: {
      _Float16* s = static_cast<_Float16*>(p);
      for (int i = 0; i < d; ++i) s[i] = static_cast<_Float16>(src[i]);
      break;
    }
  }
}

// exp(x) for the softmax's x <= 0, vectorisable (std::exp is a scalar libm call per score, which was
// most of the kernel's time at batch 32): 2^(x log2 e) as 2^n times a degree-6 polynomial in the
// remainder f in [-0.5, 0.5] (Cephes' exp2f coefficients; relative error about 2e-7).
inline float exp_nonpositive(float x) {
  x = x < -87.f ? -87.f : x;
  const float t = x * 1.44269504088896341f;
  const float n = __builtin_nearbyintf(t);
  const float f = t - n;
  float p = 1.535336188319500e-4f;
  p = p * f + 1.339887440266574e-3f;
  p = p * f + 9.618437357674640e-3f;
  p = p * f + 5.550332471162809e-2f;
  p = p * f + 2.402264791363012e-1f;
  p = p * f + 6.931472028550421e-1f;
  p = p * f + 1.0f;
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, 4);
  return p * scale;
}

inline int elem_size(int dtype) { return dtype == F32 ? 4 : (dtype == BF16 || dtype == F16) ? 2 : 1; }

struct Args {
  int q_dtype, kv_dtype;
  const char* q;
  char* out;
  int64_t q_token_stride, q_head_stride, o_token_stride, o_head_stride;
  const char* k_cache;
  const char* v_cache;
  int64_t block_stride, slot_stride;
  const int64_t* tokens;
  const int64_t* seq;
  const int64_t* pos;
  const int32_t* table;
  int64_t table_stride;
  int heads, kv_heads, d, block_size;
  float scale, k_scale, v_scale;
  int64_t window;
};

struct Scratch {
  std::vector<float> q, row, acc, scores;
};

// A cache row as float32: the row itself for a float32 cache, else converted into buf.
template <int KV>
inline const float* kv_row(const char* p, int d, float* buf) {
  if constexpr (KV == F32) {
    return reinterpret_cast<const float*>(p);
  } else {
    load_row(p, KV, d, buf);
    return buf;
  }
}

// Calls f(j - first, g - g0, row as float32) for the rows of KV heads g0 .. g1-1 of keys first .. p in
// cache (keys or values), block by block through the sequence's table.
template <int KV, typename F>
inline void for_each_row(const Args& a, const char* cache, const int32_t* blocks, int d, int g0, int g1,
                         int64_t first, int64_t p, float* buf, F&& f) {
  constexpr int64_t es = KV == F32 ? 4 : (KV == BF16 || KV == F16) ? 2 : 1;
  const int bs = a.block_size;
  for (int64_t j = first; j <= p;) {
    const int64_t b = j / bs, end = (b + 1) * bs < p + 1 ? (b + 1) * bs : p + 1;
    const char* base = cache + (blocks[b] * a.block_stride + static_cast<int64_t>(g0) * d) * es;
    for (; j < end; ++j) {
      const char* slot = base + (j - b * bs) * a.slot_stride * es;
      for (int g = 0; g < g1 - g0; ++g) f(j - first, g, kv_row<KV>(slot + static_cast<int64_t>(g) * d * es, d, buf));
    }
  }
}

// One item: token i's query heads of KV heads g0 .. g1-1. Every visible key's row is read once for all of
// them (the heads of one slot are contiguous: several KV heads per item read longer runs, which the
// prefetcher streams better). D: the head size when known at compile time (the inner loops then unroll
// completely), 0 for any.
template <int D, int KV>
void attend_item(const Args& a, int64_t i, int g0, int g1, Scratch& s) {
  const int d = D > 0 ? D : a.d;
  const int64_t q_es = elem_size(a.q_dtype);
  const int rep = a.heads / a.kv_heads;
  const int nh = (g1 - g0) * rep;  // query heads of this item, ordered (KV head, head in group)
  const int64_t p = a.pos[i];
  const int64_t first = a.window > 0 ? (p - a.window + 1 > 0 ? p - a.window + 1 : 0) : 0;
  const int64_t count = p - first + 1;
  const int32_t* blocks = a.table + a.seq[i] * a.table_stride;
  const char* qrow = a.q + a.tokens[i] * a.q_token_stride * q_es;
  float* qf = s.q.data();
  const float sc = a.scale * a.k_scale;
  for (int h = 0; h < nh; ++h) {
    load_row(qrow + (static_cast<int64_t>(g0) * rep + h) * a.q_head_stride * q_es, a.q_dtype, d, qf + h * d);
#pragma omp simd
    for (int x = 0; x < d; ++x) qf[h * d + x] *= sc;
  }
  if (static_cast<int64_t>(s.scores.size()) < nh * count) s.scores.resize(nh * count);
  float* scores = s.scores.data();
  // Scores: one pass over the visible keys.
  for_each_row<KV>(a, a.k_cache, blocks, d, g0, g1, first, p, s.row.data(), [&](int64_t j, int g, const float* k) {
    for (int r = 0; r < rep; ++r) {
      const float* qh = qf + (g * rep + r) * d;
      float acc = 0.f;
#pragma omp simd reduction(+ : acc)
      for (int x = 0; x < d; ++x) acc += qh[x] * k[x];
      scores[(g * rep + r) * count + j] = acc;
    }
  });
  // Softmax per head (v_scale folded into the normaliser).
  for (int h = 0; h < nh; ++h) {
    float* sr = scores + h * count;
    float m = sr[0];
#pragma omp simd reduction(max : m)
    for (int64_t j = 1; j < count; ++j) m = sr[j] > m ? sr[j] : m;
    float sum = 0.f;
#pragma omp simd reduction(+ : sum)
    for (int64_t j = 0; j < count; ++j) {
      sr[j] = exp_nonpositive(sr[j] - m);
      sum += sr[j];
    }
    const float inv = a.v_scale / sum;
#pragma omp simd
    for (int64_t j = 0; j < count; ++j) sr[j] *= inv;
  }
  // Values: one pass, every head of a group accumulating from the same row.
  if (static_cast<int64_t>(s.acc.size()) < nh * d) s.acc.resize(nh * d);
  float* acc = s.acc.data();
  std::fill(acc, acc + nh * d, 0.f);
  for_each_row<KV>(a, a.v_cache, blocks, d, g0, g1, first, p, s.row.data(), [&](int64_t j, int g, const float* v) {
    for (int r = 0; r < rep; ++r) {
      const float w = scores[(g * rep + r) * count + j];
      float* ah = acc + (g * rep + r) * d;
#pragma omp simd
      for (int x = 0; x < d; ++x) ah[x] += w * v[x];
    }
  });
  char* orow = a.out + a.tokens[i] * a.o_token_stride * q_es;
  for (int h = 0; h < nh; ++h)
    store_row(acc + h * d, a.q_dtype, d, orow + (static_cast<int64_t>(g0) * rep + h) * a.o_head_stride * q_es);
}

using ItemFn = void (*)(const Args&, int64_t, int, int, Scratch&);

template <int D>
ItemFn item_for_kv(int kv_dtype) {
  switch (kv_dtype) {
    case F32:
      return attend_item<D, F32>;
    case BF16:
      return attend_item<D, BF16>;
    case F16:
      return attend_item<D, F16>;
    case E4M3:
      return attend_item<D, E4M3>;
    default:
      return attend_item<D, E5M2>;
  }
}

ItemFn item_for(int d, int kv_dtype) {
  switch (d) {
    case 64:
      return item_for_kv<64>(kv_dtype);
    case 128:
      return item_for_kv<128>(kv_dtype);
    case 256:
      return item_for_kv<256>(kv_dtype);
    default:
      return item_for_kv<0>(kv_dtype);
  }
}

}  // namespace

extern "C" {

int tp_paged_attention_abi() { return 1; }

// Returns 0, or a negative value for arguments it cannot take (checked by the caller too).
int tp_paged_attention(int q_dtype, int kv_dtype, const void* q, void* out, int64_t q_token_stride,
                       int64_t q_head_stride, int64_t o_token_stride, int64_t o_head_stride, const void* k_cache,
                       const void* v_cache, int64_t block_stride, int64_t slot_stride, const int64_t* tokens,
                       const int64_t* seq, const int64_t* pos, int64_t n, const int32_t* table,
                       int64_t table_stride, int heads, int kv_heads, int d, int block_size, float scale,
                       float k_scale, float v_scale, int64_t window, int num_threads) {
  if (kv_heads <= 0 || heads % kv_heads || d <= 0 || d > 1024 || heads > 1024 || block_size <= 0) return -1;
  if (q_dtype != F32 && q_dtype != BF16 && q_dtype != F16) return -2;
  if (kv_dtype < F32 || kv_dtype > E5M2) return -3;
  const Args a{q_dtype,        kv_dtype,       static_cast<const char*>(q),       static_cast<char*>(out),
               q_token_stride, q_head_stride,  o_token_stride,                    o_head_stride,
               static_cast<const char*>(k_cache), static_cast<const char*>(v_cache), block_stride, slot_stride,
               tokens,         seq,            pos,                               table,
               table_stride,   heads,          kv_heads,                          d,
               block_size,     scale,          k_scale,                           v_scale,
               window};
  const ItemFn item = item_for(d, kv_dtype);
  // Small steps run on the calling thread: a parallel region costs more than a few short rows.
  int64_t total_keys = 0;
  for (int64_t i = 0; i < n; ++i) total_keys += pos[i] + 1;
  const bool parallel = num_threads > 1 && total_keys * heads * d > (1 << 16);
  // A token's KV heads in one item where there are tokens enough to keep every thread busy; else one KV
  // head an item, so that a lone long sequence still spreads over the threads.
  const int per_item = parallel && n < 2 * num_threads ? 1 : kv_heads;
  const int groups = kv_heads / per_item;
  const int64_t items = n * groups;
  const int threads = parallel && items > 1 ? num_threads : 1;

#pragma omp parallel num_threads(threads)
  {
    Scratch s;
    s.q.resize(static_cast<size_t>(heads) * d);
    s.acc.resize(static_cast<size_t>(heads) * d);
    s.row.resize(d);
#pragma omp for schedule(dynamic, 1)
    for (int64_t it = 0; it < items; ++it) {
      const int g0 = static_cast<int>(it % groups) * per_item;
      item(a, it / groups, g0, g0 + per_item, s);
    }
  }
  return 0;
}

}  // extern "C"

// ---------------------------------------------------------------------------------------------------------
// The small ops of a decode step around its matmuls (shard_worker/attention/cpu_ops.py): an RMS norm (with
// the residual add before it), rotary on queries and keys in place, and a layer's KV write with its
// attention in one call. At batch 1 each of them was several torch ops of a few microseconds, hundreds a
// step. Each rounds to the element type where torch rounds when it runs the same computation op by op (the
// reference: transformers' modules), so results equal the unfused ops' bit for bit, but for the order in
// which the norm's sum of squares is added up. No contraction into FMAs: torch rounds every product.
#pragma GCC push_options
#pragma GCC optimize("fp-contract=off")

namespace {

template <int DT>
inline float get(const void* p, int64_t i) {
  if constexpr (DT == F32) {
    return static_cast<const float*>(p)[i];
  } else if constexpr (DT == BF16) {
    return bf16_to_f32(static_cast<const uint16_t*>(p)[i]);
  } else {
    return static_cast<float>(static_cast<const _Float16*>(p)[i]);
  }
}

template <int DT>
inline void put(void* p, int64_t i, float v) {
  if constexpr (DT == F32) {
    static_cast<float*>(p)[i] = v;
  } else if constexpr (DT == BF16) {
    static_cast<uint16_t*>(p)[i] = f32_to_bf16(v);
  } else {
    static_cast<_Float16*>(p)[i] = static_cast<_Float16>(v);
  }
}

// v rounded to the element type (what a torch op in that type returns), as float32.
template <int DT>
inline float rnd(float v) {
  if constexpr (DT == F32) {
    return v;
  } else if constexpr (DT == BF16) {
    return bf16_to_f32(f32_to_bf16(v));
  } else {
    return static_cast<float>(static_cast<_Float16>(v));
  }
}

struct NormArgs {
  const char* x;
  int64_t x_stride;
  const char* delta;  // null, or rows added to x first
  int64_t d_stride;
  char* sum;  // with delta: x + delta, contiguous rows
  char* out;  // contiguous rows
  const void* weight;  // [hidden], the element type
  int64_t hidden;
  float eps;
  int gemma;
};

// Llama (transformers' LlamaRMSNorm): weight * round(x * rsqrt(mean(x^2) + eps)), the norm in float32 and
// the product in the element type. Gemma: x * rsqrt(...) * (1 + float(weight)), all of it in float32.
template <int DT>
void norm_row(const NormArgs& a, int64_t r, float* s) {
  constexpr int64_t es = DT == F32 ? 4 : 2;
  const char* x = a.x + r * a.x_stride * es;
  const int64_t n = a.hidden;
  float ss = 0.f;
  if (a.delta) {
    const char* d = a.delta + r * a.d_stride * es;
    char* sum = a.sum + r * n * es;
    for (int64_t i = 0; i < n; ++i) {
      s[i] = rnd<DT>(get<DT>(x, i) + get<DT>(d, i));
      put<DT>(sum, i, s[i]);
    }
  } else {
    for (int64_t i = 0; i < n; ++i) s[i] = get<DT>(x, i);
  }
#pragma omp simd reduction(+ : ss)
  for (int64_t i = 0; i < n; ++i) {
    const float sq = s[i] * s[i];
    ss += sq;
  }
  const float inv = 1.0f / std::sqrt(ss / static_cast<float>(n) + a.eps);
  char* o = a.out + r * n * es;
  if (a.gemma) {
#pragma omp simd
    for (int64_t i = 0; i < n; ++i) {
      const float w = 1.0f + get<DT>(a.weight, i);
      put<DT>(o, i, s[i] * inv * w);
    }
  } else {
#pragma omp simd
    for (int64_t i = 0; i < n; ++i) put<DT>(o, i, get<DT>(a.weight, i) * rnd<DT>(s[i] * inv));
  }
}

template <int DT>
void norm_rows(const NormArgs& a, int64_t rows, int threads) {
#pragma omp parallel num_threads(threads)
  {
    std::vector<float> s(a.hidden);
#pragma omp for schedule(static)
    for (int64_t r = 0; r < rows; ++r) norm_row<DT>(a, r, s.data());
  }
}

// x [tokens, heads, d] in place: x * cos + rotate_half(x) * sin, rotate_half(x) = (-x2, x1) for the halves
// x1, x2; every product and the sum rounded to the element type as torch's ops round them.
template <int DT>
void rotary_head(char* x, const char* c, const char* s, int d) {
  const int half = d / 2;
  for (int i = 0; i < half; ++i) {
    const float x1 = get<DT>(x, i), x2 = get<DT>(x, i + half);
    const float a1 = rnd<DT>(x1 * get<DT>(c, i)), b1 = rnd<DT>(-x2 * get<DT>(s, i));
    const float a2 = rnd<DT>(x2 * get<DT>(c, i + half)), b2 = rnd<DT>(x1 * get<DT>(s, i + half));
    put<DT>(x, i, a1 + b1);
    put<DT>(x, i + half, a2 + b2);
  }
}

struct RotaryArgs {
  char* q;
  int64_t q_tok, q_head;
  int q_heads;
  char* k;
  int64_t k_tok, k_head;
  int k_heads;
  const char* cos;
  const char* sin;
  int64_t cs_stride;
  int d;
};

template <int DT>
void rotary_rows(const RotaryArgs& a, int64_t tokens, int threads) {
  constexpr int64_t es = DT == F32 ? 4 : 2;
#pragma omp parallel for num_threads(threads) schedule(static)
  for (int64_t t = 0; t < tokens; ++t) {
    const char* c = a.cos + t * a.cs_stride * es;
    const char* s = a.sin + t * a.cs_stride * es;
    for (int h = 0; h < a.q_heads; ++h) rotary_head<DT>(a.q + (t * a.q_tok + h * a.q_head) * es, c, s, a.d);
    for (int h = 0; h < a.k_heads; ++h) rotary_head<DT>(a.k + (t * a.k_tok + h * a.k_head) * es, c, s, a.d);
  }
}

// exp(x) for any x: exp_nonpositive's polynomial (it holds up to 88.7), inf above.
inline float exp_any(float x) { return x > 88.7f ? INFINITY : exp_nonpositive(x); }

// out = silu(gate) * up for rows [gate | up] of x: silu rounded to the element type, then the product, as
// torch's F.silu and mul round them (silu(g) = g / (1 + exp(-g)) in float32).
template <int DT>
void silu_mul_rows(const char* x, int64_t x_stride, char* out, int64_t rows, int64_t inter, int threads) {
  constexpr int64_t es = DT == F32 ? 4 : 2;
#pragma omp parallel for num_threads(threads) schedule(static)
  for (int64_t r = 0; r < rows; ++r) {
    const char* g = x + r * x_stride * es;
    const char* u = g + inter * es;
    char* o = out + r * inter * es;
#pragma omp simd
    for (int64_t i = 0; i < inter; ++i) {
      const float gv = get<DT>(g, i);
      put<DT>(o, i, rnd<DT>(gv / (1.0f + exp_any(-gv))) * get<DT>(u, i));
    }
  }
}

// Above this many elements a call spreads over the threads; below it a parallel region costs more.
constexpr int64_t kParallelElements = 1 << 16;

}  // namespace

extern "C" {

// out[r] = norm(x[r] (+ delta[r])) for rows r (x and delta: row strides in elements, each row contiguous);
// with delta, the sum is written to sum. sum and out: [rows, hidden] contiguous. Returns 0, or a negative
// value for a dtype it does not take.
int tp_rms_norm(int dtype, const void* x, int64_t x_stride, const void* delta, int64_t d_stride, void* sum,
                void* out, const void* weight, int64_t rows, int64_t hidden, float eps, int gemma,
                int num_threads) {
  if (hidden <= 0) return -1;
  const NormArgs a{static_cast<const char*>(x),
                   x_stride,
                   static_cast<const char*>(delta),
                   d_stride,
                   static_cast<char*>(sum),
                   static_cast<char*>(out),
                   weight,
                   hidden,
                   eps,
                   gemma};
  const int threads = num_threads > 1 && rows > 1 && rows * hidden > kParallelElements ? num_threads : 1;
  switch (dtype) {
    case F32:
      norm_rows<F32>(a, rows, threads);
      return 0;
    case BF16:
      norm_rows<BF16>(a, rows, threads);
      return 0;
    case F16:
      norm_rows<F16>(a, rows, threads);
      return 0;
    default:
      return -2;
  }
}

// Rotary in place on q [tokens, q_heads, d] and k [tokens, k_heads, d] (strides in elements, each head's
// d elements contiguous), cos and sin [tokens, d] (row stride cs_stride) in the same element type.
int tp_rotary(int dtype, void* q, int64_t q_tok, int64_t q_head, int q_heads, void* k, int64_t k_tok,
              int64_t k_head, int k_heads, const void* cos, const void* sin, int64_t cs_stride, int64_t tokens,
              int d, int num_threads) {
  if (d <= 0 || d % 2) return -1;
  const RotaryArgs a{static_cast<char*>(q),         q_tok,     q_head, q_heads, static_cast<char*>(k), k_tok,
                     k_head,                        k_heads,   static_cast<const char*>(cos),
                     static_cast<const char*>(sin), cs_stride, d};
  const int64_t work = tokens * (q_heads + k_heads) * d;
  const int threads = num_threads > 1 && tokens > 1 && work > kParallelElements ? num_threads : 1;
  switch (dtype) {
    case F32:
      rotary_rows<F32>(a, tokens, threads);
      return 0;
    case BF16:
      rotary_rows<BF16>(a, tokens, threads);
      return 0;
    case F16:
      rotary_rows<F16>(a, tokens, threads);
      return 0;
    default:
      return -2;
  }
}

// out [rows, inter] (contiguous) = silu(x[:, :inter]) * x[:, inter:], x's rows x_stride elements apart.
int tp_silu_mul(int dtype, const void* x, int64_t x_stride, void* out, int64_t rows, int64_t inter,
                int num_threads) {
  const char* xs = static_cast<const char*>(x);
  char* o = static_cast<char*>(out);
  const int threads = num_threads > 1 && rows > 1 && rows * inter > kParallelElements ? num_threads : 1;
  switch (dtype) {
    case F32:
      silu_mul_rows<F32>(xs, x_stride, o, rows, inter, threads);
      return 0;
    case BF16:
      silu_mul_rows<BF16>(xs, x_stride, o, rows, inter, threads);
      return 0;
    case F16:
      silu_mul_rows<F16>(xs, x_stride, o, rows, inter, threads);
      return 0;
    default:
      return -2;
  }
}

// out[r] = the first index of row r's largest value (of its first NaN, if it has one), as torch.argmax
// answers; float32 rows of cols values, row_stride apart. torch's CPU argmax compares one element at a
// time (0.5 ms for 8 rows of a 49k vocabulary); here a vectorised max, then a search for its first index.
int tp_argmax(const float* x, int64_t rows, int64_t cols, int64_t row_stride, int64_t* out) {
  if (cols <= 0) return -1;
  for (int64_t r = 0; r < rows; ++r) {
    const float* row = x + r * row_stride;
    float m = -INFINITY;
    int nan = 0;
#pragma omp simd reduction(max : m) reduction(| : nan)
    for (int64_t i = 0; i < cols; ++i) {
      m = row[i] > m ? row[i] : m;
      nan |= row[i] != row[i];
    }
    int64_t found = 0;
    for (int64_t at = 0; at < cols; at += 64) {  // a block holding the answer, then the answer in it
      const int64_t end = at + 64 < cols ? at + 64 : cols;
      int hit = 0;
#pragma omp simd reduction(| : hit)
      for (int64_t i = at; i < end; ++i) hit |= nan ? row[i] != row[i] : row[i] == m;
      if (!hit) continue;
      found = at;
      while (!(nan ? row[found] != row[found] : row[found] == m)) ++found;
      break;
    }
    out[r] = found;
  }
  return 0;
}

// What every layer's attention call of one step shares, built once a step (cpu.py's prepare).
struct StepPlan {
  const int64_t* tokens;  // [n] the step rows the kernel attends, their sequences and positions
  const int64_t* seq;
  const int64_t* pos;
  int64_t n;
  const int32_t* table;  // [S, table_stride] the block table
  int64_t table_stride;
  const int64_t* slots;  // [num_tokens] each step row's KV slot
  int64_t num_tokens;
  int32_t num_threads;
};

// One layer: the step's keys and values (k, v: [num_tokens, kv_heads, d], heads contiguous, token strides
// in elements; in the cache's element type) copied to their slots of cache [2, num_blocks, block_size,
// kv_heads, d] (contiguous), then the plan's rows attended into out ([num_tokens, heads, d], contiguous).
// Returns 0; -4 for a slot outside the cache (nothing written); the attention's codes otherwise.
int tp_attention_layer(const StepPlan* st, int q_dtype, int kv_dtype, const void* q, int64_t q_tok,
                       int64_t q_head, const void* k, int64_t k_tok, const void* v, int64_t v_tok, void* cache,
                       int64_t num_blocks, void* out, int heads, int kv_heads, int d, int block_size, float scale,
                       float k_scale, float v_scale, int64_t window) {
  const int64_t es = elem_size(kv_dtype);
  const int64_t row = static_cast<int64_t>(kv_heads) * d;
  const int64_t slots = num_blocks * block_size;
  char* k_cache = static_cast<char*>(cache);
  char* v_cache = k_cache + slots * row * es;
  for (int64_t t = 0; t < st->num_tokens; ++t)
    if (st->slots[t] < 0 || st->slots[t] >= slots) return -4;
  for (int64_t t = 0; t < st->num_tokens; ++t) {
    std::memcpy(k_cache + st->slots[t] * row * es, static_cast<const char*>(k) + t * k_tok * es, row * es);
    std::memcpy(v_cache + st->slots[t] * row * es, static_cast<const char*>(v) + t * v_tok * es, row * es);
  }
  if (st->n == 0) return 0;
  const int64_t o_tok = static_cast<int64_t>(heads) * d;
  return tp_paged_attention(q_dtype, kv_dtype, q, out, q_tok, q_head, o_tok, d, k_cache, v_cache,
                            static_cast<int64_t>(block_size) * row, row, st->tokens, st->seq, st->pos, st->n,
                            st->table, st->table_stride, heads, kv_heads, d, block_size, scale, k_scale,
                            v_scale, window, st->num_threads);
}

}  // extern "C"

#pragma GCC pop_options
