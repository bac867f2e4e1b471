// What the CPU attention kernel (cpu_paged_attention.cpp) and the small ops beside it (cpu_small_ops.cpp)
// share: the element types and their conversions, a vectorisable exp, and the attention entry point the
// fused layer call uses. Both sources are compiled into one library (shard_worker/attention/cpu_kernel.py).
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

namespace tp_cpu {

enum Dtype { F32 = 0, BF16 = 1, F16 = 2, E4M3 = 3, E5M2 = 4 };

inline int elem_size(int dtype) { return dtype == F32 ? 4 : (dtype == BF16 || dtype == F16) ? 2 : 1; }

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

}  // namespace tp_cpu

extern "C" int tp_paged_attention(int q_dtype, int kv_dtype, const void* q, void* out, int64_t q_token_stride,
                                  int64_t q_head_stride, int64_t o_token_stride, int64_t o_head_stride,
                                  const void* k_cache, const void* v_cache, int64_t block_stride,
                                  int64_t slot_stride, const int64_t* tokens, const int64_t* seq,
                                  const int64_t* pos, int64_t n, const int32_t* table, int64_t table_stride,
                                  int heads, int kv_heads, int d, int block_size, float scale, float k_scale,
                                  float v_scale, int64_t window, int num_threads, int64_t num_seqs,
                                  int64_t table_width, int64_t num_blocks, int64_t* fault,
                                  const float* sinks);
