#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include <omp.h>

#include "cpu_kernels.h"

using namespace tp_cpu;

// The small ops of a decode step around its matmuls (shard_worker/attention/cpu_ops.py), compiled into the
// attention kernel's library (shard_worker/attention/cpu_kernel.py): an RMS norm (with
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
  int64_t num_seqs;     // S: the table's rows
  int64_t table_width;  // ids a row holds (<= table_stride)
  int64_t* fault;       // [3] where tp_paged_attention says what it refused
  const int64_t* slots;  // [num_tokens] each step row's KV slot
  int64_t num_tokens;
  int32_t num_threads;
};

// One layer: the step's keys and values (k, v: [num_tokens, kv_heads, d], heads contiguous, token strides
// in elements; in the cache's element type) copied to their slots of cache [2, num_blocks, block_size,
// kv_heads, d] (contiguous), then the plan's rows attended into out ([num_tokens, heads, d], contiguous).
// sinks: float32 [heads] or null (tp_paged_attention). Returns 0; -4 for a slot outside the cache (nothing
// written); the attention's codes otherwise.
int tp_attention_layer(const StepPlan* st, int q_dtype, int kv_dtype, const void* q, int64_t q_tok,
                       int64_t q_head, const void* k, int64_t k_tok, const void* v, int64_t v_tok, void* cache,
                       int64_t num_blocks, void* out, int heads, int kv_heads, int d, int block_size, float scale,
                       float k_scale, float v_scale, int64_t window, const float* sinks) {
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
                            v_scale, window, st->num_threads, st->num_seqs, st->table_width, num_blocks,
                            st->fault, sinks);
}

}  // extern "C"

#pragma GCC pop_options
