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
// Bounds: the table has num_seqs rows of table_width ids, the cache num_blocks blocks. A token whose
// sequence is past the rows (-7) or whose position needs a column past the width (-6) is refused before
// anything runs, and a block id outside [0, num_blocks) when it is read (-5: that item stops, the others
// go on, the call fails); fault then holds {sequence row, column, the id (-6: the width; -7: the rows)}.
// Never a read outside the cache or the table.
// sinks (null: none): gpt-oss's per-head logit [heads] in float32, one more term exp(sink) in each softmax's
// denominator (a key every query sees whose value is zero).
//
// One work item is a token's query heads of one or all of its KV heads: the heads that share a KV head
// share every key and value row read.
// Scores for the whole visible context are computed first (one pass over the keys), then softmax, then
// one pass over the values. The scores buffer is per thread and grows to the longest context seen.

#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include <omp.h>

#include "cpu_kernels.h"

using namespace tp_cpu;

namespace {

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

// The first bad block id a thread met (the call then fails with it).
struct Fault {
  std::atomic<int> set{0};
  int64_t row = 0, column = 0, id = 0;
  void record(int64_t r, int64_t c, int64_t i) {
    int expected = 0;
    if (set.compare_exchange_strong(expected, 1)) row = r, column = c, id = i;
  }
};

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
  int64_t num_blocks;
  Fault* fault;
  const float* sinks;
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
// cache (keys or values), block by block through the sequence's table (row `row`). False, with the fault
// recorded, at a block id outside the cache (nothing of it read).
template <int KV, typename F>
inline bool for_each_row(const Args& a, const char* cache, int64_t row, int d, int g0, int g1, int64_t first,
                         int64_t p, float* buf, F&& f) {
  constexpr int64_t es = KV == F32 ? 4 : (KV == BF16 || KV == F16) ? 2 : 1;
  const int bs = a.block_size;
  const int32_t* blocks = a.table + row * a.table_stride;
  for (int64_t j = first; j <= p;) {
    const int64_t b = j / bs, end = (b + 1) * bs < p + 1 ? (b + 1) * bs : p + 1;
    if (blocks[b] < 0 || blocks[b] >= a.num_blocks) {
      a.fault->record(row, b, blocks[b]);
      return false;
    }
    const char* base = cache + (blocks[b] * a.block_stride + static_cast<int64_t>(g0) * d) * es;
    for (; j < end; ++j) {
      const char* slot = base + (j - b * bs) * a.slot_stride * es;
      for (int g = 0; g < g1 - g0; ++g) f(j - first, g, kv_row<KV>(slot + static_cast<int64_t>(g) * d * es, d, buf));
    }
  }
  return true;
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
  const bool keys_read = for_each_row<KV>(a, a.k_cache, a.seq[i], d, g0, g1, first, p, s.row.data(), [&](int64_t j, int g, const float* k) {
    for (int r = 0; r < rep; ++r) {
      const float* qh = qf + (g * rep + r) * d;
      float acc = 0.f;
#pragma omp simd reduction(+ : acc)
      for (int x = 0; x < d; ++x) acc += qh[x] * k[x];
      scores[(g * rep + r) * count + j] = acc;
    }
  });
  if (!keys_read) return;
  // Softmax per head (v_scale folded into the normaliser), the head's sink in the max and the sum.
  for (int h = 0; h < nh; ++h) {
    float* sr = scores + h * count;
    float m = sr[0];
#pragma omp simd reduction(max : m)
    for (int64_t j = 1; j < count; ++j) m = sr[j] > m ? sr[j] : m;
    const float sink = a.sinks ? a.sinks[g0 * rep + h] : 0.f;
    if (a.sinks && sink > m) m = sink;
    float sum = a.sinks ? exp_nonpositive(sink - m) : 0.f;
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
  // The same blocks as the keys': every id was checked there.
  for_each_row<KV>(a, a.v_cache, a.seq[i], d, g0, g1, first, p, s.row.data(), [&](int64_t j, int g, const float* v) {
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

int tp_paged_attention_abi() { return 3; }

// Returns 0, or a negative value for arguments it cannot take (checked by the caller too); -5, -6 and -7
// with fault[3] filled (see the bounds at the top).
int tp_paged_attention(int q_dtype, int kv_dtype, const void* q, void* out, int64_t q_token_stride,
                       int64_t q_head_stride, int64_t o_token_stride, int64_t o_head_stride, const void* k_cache,
                       const void* v_cache, int64_t block_stride, int64_t slot_stride, const int64_t* tokens,
                       const int64_t* seq, const int64_t* pos, int64_t n, const int32_t* table,
                       int64_t table_stride, int heads, int kv_heads, int d, int block_size, float scale,
                       float k_scale, float v_scale, int64_t window, int num_threads, int64_t num_seqs,
                       int64_t table_width, int64_t num_blocks, int64_t* fault, const float* sinks) {
  if (kv_heads <= 0 || heads % kv_heads || d <= 0 || d > 1024 || heads > 1024 || block_size <= 0) return -1;
  if (q_dtype != F32 && q_dtype != BF16 && q_dtype != F16) return -2;
  if (kv_dtype < F32 || kv_dtype > E5M2) return -3;
  if (table_width > table_stride || num_blocks < 0) return -1;
  for (int64_t i = 0; i < n; ++i) {
    if (seq[i] < 0 || seq[i] >= num_seqs) {
      fault[0] = seq[i], fault[1] = 0, fault[2] = num_seqs;
      return -7;
    }
    if (pos[i] < 0 || pos[i] / block_size >= table_width) {
      fault[0] = seq[i], fault[1] = pos[i] < 0 ? -1 : pos[i] / block_size, fault[2] = table_width;
      return -6;
    }
  }
  Fault bad;
  const Args a{q_dtype,        kv_dtype,       static_cast<const char*>(q),       static_cast<char*>(out),
               q_token_stride, q_head_stride,  o_token_stride,                    o_head_stride,
               static_cast<const char*>(k_cache), static_cast<const char*>(v_cache), block_stride, slot_stride,
               tokens,         seq,            pos,                               table,
               table_stride,   heads,          kv_heads,                          d,
               block_size,     scale,          k_scale,                           v_scale,
               window,         num_blocks,     &bad,                              sinks};
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
  if (bad.set.load()) {
    fault[0] = bad.row, fault[1] = bad.column, fault[2] = bad.id;
    return -5;
  }
  return 0;
}

}  // extern "C"
