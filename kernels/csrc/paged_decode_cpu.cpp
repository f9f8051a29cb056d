// Paged decode attention on the CPU, reading the paged KV cache in place.
//
// One query token per sequence attends to its context through its block table, block by
// block, with an online softmax (Milakov & Gimelshein 2018, as in FlashAttention and vLLM's
// paged_attention_v1): no gathered or padded copy of the context is made. Work is split over
// (sequence, KV head) pairs with at::parallel_for (torch's intra-op threads); the query heads
// of one GQA group share each K/V row they read. Scores, softmax and the weighted sum are fp32
// whatever the cache dtype (fp32 or bf16).
//
// Shapes (contiguous): q [num_seqs, num_heads, head_dim]; k_cache, v_cache [num_blocks,
// block_size, num_kv_heads, head_dim]; block_tables [num_seqs, max_num_blocks] int32;
// context_lens [num_seqs] int32. Returns [num_seqs, num_heads, head_dim] in q's dtype.
#include "cpu_kernels.h"

#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

namespace {

// ---- row helpers: AVX-512 where head_dim is a multiple of 16, else portable loops ----
inline void to_f32(const float* src, float* dst, int64_t n) { std::memcpy(dst, src, n * sizeof(float)); }

inline void to_f32(const at::BFloat16* src, float* dst, int64_t n) {
  int64_t d = 0;
#if defined(__AVX512F__)
  for (; d + 16 <= n; d += 16) {  // bf16 -> fp32 is a 16-bit shift
    const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + d));
    _mm512_storeu_ps(dst + d, _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16)));
  }
#endif
  for (; d < n; ++d) dst[d] = static_cast<float>(src[d]);
}

inline float dot(const float* a, const float* b, int64_t n) {
  int64_t d = 0;
  float s = 0.f;
#if defined(__AVX512F__)
  __m512 acc = _mm512_setzero_ps();
  for (; d + 16 <= n; d += 16) acc = _mm512_fmadd_ps(_mm512_loadu_ps(a + d), _mm512_loadu_ps(b + d), acc);
  s = _mm512_reduce_add_ps(acc);
#endif
  for (; d < n; ++d) s += a[d] * b[d];
  return s;
}

inline void axpy(float p, const float* x, float* y, int64_t n) {  // y += p * x
  int64_t d = 0;
#if defined(__AVX512F__)
  const __m512 pv = _mm512_set1_ps(p);
  for (; d + 16 <= n; d += 16) _mm512_storeu_ps(y + d, _mm512_fmadd_ps(pv, _mm512_loadu_ps(x + d), _mm512_loadu_ps(y + d)));
#endif
  for (; d < n; ++d) y[d] += p * x[d];
}

#if defined(__AVX512F__)
// e^x for 16 lanes: x = n ln2 + r, |r| <= ln2 / 2, a degree-6 Taylor polynomial of e^r
// (relative error < 2e-7) scaled by 2^n; x below -87 gives ~0 (as -inf does for std::exp).
inline __m512 exp16(__m512 x) {
  x = _mm512_max_ps(_mm512_min_ps(x, _mm512_set1_ps(88.f)), _mm512_set1_ps(-87.f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);  // ln2 in two parts (Cody-Waite)
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 p = _mm512_set1_ps(1.f / 720.f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 120.f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 24.f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 6.f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f));
  return _mm512_scalef_ps(p, n);
}
#endif

// s[t] = exp(s[t] - m) for t < n; returns their sum
inline float exp_shifted(float* s, int64_t n, float m) {
  int64_t t = 0;
  float sum = 0.f;
#if defined(__AVX512F__)
  const __m512 mv = _mm512_set1_ps(m);
  __m512 acc = _mm512_setzero_ps();
  for (; t < n; t += 16) {
    const __mmask16 k = n - t >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << (n - t)) - 1);
    const __m512 p = exp16(_mm512_sub_ps(_mm512_maskz_loadu_ps(k, s + t), mv));
    _mm512_mask_storeu_ps(s + t, k, p);
    acc = _mm512_add_ps(acc, _mm512_maskz_mov_ps(k, p));
  }
  sum = _mm512_reduce_add_ps(acc);
#endif
  for (; t < n; ++t) {
    s[t] = std::exp(s[t] - m);
    sum += s[t];
  }
  return sum;
}

template <typename T>
inline void prefetch_rows(const T* k, const T* v, int64_t rows, int64_t stride, int64_t row_bytes) {
  for (int64_t t = 0; t < rows; ++t)
    for (int64_t off = 0; off < row_bytes; off += 64) {
      _mm_prefetch(reinterpret_cast<const char*>(k + t * stride) + off, _MM_HINT_T0);
      _mm_prefetch(reinterpret_cast<const char*>(v + t * stride) + off, _MM_HINT_T0);
    }
}

#if defined(__AVX512BF16__)
// lane t of the result = the sum of v[t]'s 16 lanes (a 16 x 16 transpose-and-add: 15 adds and
// 30 shuffles for 16 sums, where 16 separate horizontal sums take about 8 instructions each)
inline __m512 reduce16(const __m512* v) {
  __m512 x[8], z[4];
  for (int i = 0; i < 8; ++i)
    x[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]), _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
  for (int i = 0; i < 4; ++i)
    z[i] = _mm512_add_ps(_mm512_shuffle_ps(x[2 * i], x[2 * i + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                         _mm512_shuffle_ps(x[2 * i], x[2 * i + 1], _MM_SHUFFLE(3, 2, 3, 2)));
  const __m512 u01 = _mm512_add_ps(_mm512_shuffle_f32x4(z[0], z[1], _MM_SHUFFLE(1, 0, 1, 0)),
                                   _mm512_shuffle_f32x4(z[0], z[1], _MM_SHUFFLE(3, 2, 3, 2)));
  const __m512 u23 = _mm512_add_ps(_mm512_shuffle_f32x4(z[2], z[3], _MM_SHUFFLE(1, 0, 1, 0)),
                                   _mm512_shuffle_f32x4(z[2], z[3], _MM_SHUFFLE(3, 2, 3, 2)));
  return _mm512_add_ps(_mm512_shuffle_f32x4(u01, u23, _MM_SHUFFLE(2, 0, 2, 0)),
                       _mm512_shuffle_f32x4(u01, u23, _MM_SHUFFLE(3, 1, 3, 1)));
}

// bf16 q . k of a block with vdpbf16ps on the rows as stored (no conversion), 16 tokens at a
// time: s[g * s_stride + t] = scale * q_g . k_t, bmax[g] = max(bmax[g], those scores).
template <int HD>
void scores_bf16(const at::BFloat16* q, const at::BFloat16* kb, int64_t ntok, int64_t tok_stride, int64_t group,
                 float scale, float* s, int64_t s_stride, float* bmax) {
  constexpr int V = HD / 32;
  const __m512 sv = _mm512_set1_ps(scale);
  for (int64_t g = 0; g < group; ++g) {
    __m512bh qv[V];
    for (int j = 0; j < V; ++j) qv[j] = (__m512bh)_mm512_loadu_si512(q + g * HD + 32 * j);
    for (int64_t c0 = 0; c0 < ntok; c0 += 16) {
      const int64_t n = std::min<int64_t>(16, ntok - c0);
      __m512 acc[16];
      for (int t = 0; t < 16; ++t) {
        acc[t] = _mm512_setzero_ps();
        if (t < n) {
          const at::BFloat16* kr = kb + (c0 + t) * tok_stride;
          for (int j = 0; j < V; ++j) acc[t] = _mm512_dpbf16_ps(acc[t], qv[j], (__m512bh)_mm512_loadu_si512(kr + 32 * j));
        }
      }
      const __mmask16 m = n >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << n) - 1);
      const __m512 r = _mm512_mul_ps(reduce16(acc), sv);
      _mm512_mask_storeu_ps(s + g * s_stride + c0, m, r);
      bmax[g] = std::max(bmax[g], _mm512_mask_reduce_max_ps(m, r));
    }
  }
}

// acc[g] += sum_t p[g * p_stride + t] * v_t for a block: each bf16 V row widened once, in registers
template <int HD>
void values_bf16(const at::BFloat16* vb, int64_t ntok, int64_t tok_stride, int64_t group, const float* p,
                 int64_t p_stride, float* acc) {
  constexpr int V = HD / 16;
  for (int64_t t = 0; t < ntok; ++t) {
    const at::BFloat16* vr = vb + t * tok_stride;
    __m512 v[V];
    for (int j = 0; j < V; ++j)
      v[j] = _mm512_castsi512_ps(_mm512_slli_epi32(
          _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(vr + 16 * j))), 16));
    for (int64_t g = 0; g < group; ++g) {
      const __m512 pv = _mm512_set1_ps(p[g * p_stride + t]);
      float* a = acc + g * HD;
      for (int j = 0; j < V; ++j) _mm512_storeu_ps(a + 16 * j, _mm512_fmadd_ps(pv, v[j], _mm512_loadu_ps(a + 16 * j)));
    }
  }
}
#endif

template <typename T>
inline bool block_values(const T* vb, int64_t ntok, int64_t tok_stride, int64_t head_dim, int64_t group,
                         const float* p, int64_t p_stride, float* acc) {
#if defined(__AVX512BF16__)
  if constexpr (std::is_same_v<T, at::BFloat16>) {
    if (head_dim == 64) {
      values_bf16<64>(vb, ntok, tok_stride, group, p, p_stride, acc);
      return true;
    }
    if (head_dim == 128) {
      values_bf16<128>(vb, ntok, tok_stride, group, p, p_stride, acc);
      return true;
    }
  }
#endif
  return false;
}

// The scores of one block for a GQA group (see scores_bf16); false where this build has no
// fast path for the dtype or head_dim (the caller then computes them row by row).
template <typename T>
inline bool block_scores(const T* q, const T* kb, int64_t ntok, int64_t tok_stride, int64_t head_dim, int64_t group,
                         float scale, float* s, int64_t s_stride, float* bmax) {
#if defined(__AVX512BF16__)
  if constexpr (std::is_same_v<T, at::BFloat16>) {
    if (head_dim == 64) {
      scores_bf16<64>(q, kb, ntok, tok_stride, group, scale, s, s_stride, bmax);
      return true;
    }
    if (head_dim == 128) {
      scores_bf16<128>(q, kb, ntok, tok_stride, group, scale, s, s_stride, bmax);
      return true;
    }
  }
#endif
  return false;
}

inline void scale_row(float c, float* y, int64_t n) {
  for (int64_t d = 0; d < n; ++d) y[d] *= c;
}

template <typename T>
void decode(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
            const at::Tensor& block_tables, const at::Tensor& context_lens, at::Tensor& out, double scale) {
  const int64_t num_seqs = q.size(0), num_heads = q.size(1), head_dim = q.size(2);
  const int64_t num_blocks = k_cache.size(0), block_size = k_cache.size(1), num_kv_heads = k_cache.size(2);
  const int64_t group = num_heads / num_kv_heads, max_blocks = block_tables.size(1);
  const int64_t tok_stride = num_kv_heads * head_dim, blk_stride = block_size * tok_stride;
  const T* qp = q.data_ptr<T>();
  const T* kp = k_cache.data_ptr<T>();
  const T* vp = v_cache.data_ptr<T>();
  T* op = out.data_ptr<T>();
  const int32_t* tables = block_tables.data_ptr<int32_t>();
  const int32_t* lens = context_lens.data_ptr<int32_t>();
  const float fscale = static_cast<float>(scale);
  const float neg_inf = -std::numeric_limits<float>::infinity();

  at::parallel_for(0, num_seqs * num_kv_heads, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> qf(group * head_dim), acc(group * head_dim), row(head_dim), m(group), l(group),
        s(group * block_size);
    for (int64_t idx = begin; idx < end; ++idx) {
      const int64_t seq = idx / num_kv_heads, kvh = idx % num_kv_heads;
      const int64_t ctx = lens[seq];
      for (int64_t g = 0; g < group; ++g) {
        const T* qh = qp + (seq * num_heads + kvh * group + g) * head_dim;
        for (int64_t d = 0; d < head_dim; ++d) qf[g * head_dim + d] = static_cast<float>(qh[d]) * fscale;
        m[g] = neg_inf;
        l[g] = 0.f;
      }
      std::fill(acc.begin(), acc.end(), 0.f);
      const int64_t nblk = ctx > 0 ? (ctx + block_size - 1) / block_size : 0;
      TORCH_CHECK(nblk <= max_blocks, "context_lens[", seq, "]=", ctx, " needs ", nblk,
                  " blocks but block_tables has ", max_blocks, " columns");
      for (int64_t b = 0; b < nblk; ++b) {
        const int64_t blk = tables[seq * max_blocks + b];
        TORCH_CHECK(blk >= 0 && blk < num_blocks, "block_tables[", seq, "][", b, "]=", blk,
                    " is outside the cache's ", num_blocks, " blocks");
        const int64_t ntok = std::min(block_size, ctx - b * block_size);
        const T* kb = kp + blk * blk_stride + kvh * head_dim;
        const T* vb = vp + blk * blk_stride + kvh * head_dim;
        if (b + 1 < nblk) {  // the next block's rows: a block is 2 x block_size strided rows, which
          // the hardware prefetchers do not foresee; without this the loads wait on memory
          const int64_t nxt = tables[seq * max_blocks + b + 1];
          if (nxt >= 0 && nxt < num_blocks) prefetch_rows(kp + nxt * blk_stride + kvh * head_dim,
                                                         vp + nxt * blk_stride + kvh * head_dim,
                                                         block_size, tok_stride, head_dim * sizeof(T));
        }
        float bmax[64];  // per group head (group <= 64 checked by the caller)
        for (int64_t g = 0; g < group; ++g) bmax[g] = neg_inf;
        if (!block_scores(qp + (seq * num_heads + kvh * group) * head_dim, kb, ntok, tok_stride, head_dim, group,
                          fscale, s.data(), block_size, bmax)) {
          for (int64_t t = 0; t < ntok; ++t) {
            to_f32(kb + t * tok_stride, row.data(), head_dim);
            for (int64_t g = 0; g < group; ++g) {
              const float sc = dot(qf.data() + g * head_dim, row.data(), head_dim);
              s[g * block_size + t] = sc;
              bmax[g] = std::max(bmax[g], sc);
            }
          }
        }
        for (int64_t g = 0; g < group; ++g) {
          const float mnew = std::max(m[g], bmax[g]);
          const float corr = std::exp(m[g] - mnew);  // 0 on the first block (m = -inf)
          l[g] *= corr;
          scale_row(corr, acc.data() + g * head_dim, head_dim);
          l[g] += exp_shifted(s.data() + g * block_size, ntok, mnew);
          m[g] = mnew;
        }
        if (!block_values(vb, ntok, tok_stride, head_dim, group, s.data(), block_size, acc.data())) {
          for (int64_t t = 0; t < ntok; ++t) {
            to_f32(vb + t * tok_stride, row.data(), head_dim);
            for (int64_t g = 0; g < group; ++g)
              axpy(s[g * block_size + t], row.data(), acc.data() + g * head_dim, head_dim);
          }
        }
      }
      for (int64_t g = 0; g < group; ++g) {
        T* oh = op + (seq * num_heads + kvh * group + g) * head_dim;
        const float inv = l[g] > 0.f ? 1.f / l[g] : 0.f;  // empty context: zeros
        for (int64_t d = 0; d < head_dim; ++d) oh[d] = static_cast<T>(acc[g * head_dim + d] * inv);
      }
    }
  });
}

}  // namespace

namespace epd {

at::Tensor paged_decode_attention_cpu(at::Tensor q, at::Tensor k_cache, at::Tensor v_cache,
                                      at::Tensor block_tables, at::Tensor context_lens, double scale) {
  TORCH_CHECK(q.device().is_cpu() && k_cache.device().is_cpu() && v_cache.device().is_cpu(), "CPU tensors only");
  TORCH_CHECK(k_cache.scalar_type() == q.scalar_type() && v_cache.scalar_type() == q.scalar_type(),
              "q, k_cache and v_cache must share a dtype");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous(), "the caches must be contiguous");
  TORCH_CHECK(q.size(1) % k_cache.size(2) == 0 && q.size(1) / k_cache.size(2) <= 64,
              "num_heads must be a multiple of num_kv_heads, at most 64 query heads per KV head");
  q = q.contiguous();
  block_tables = block_tables.to(at::kInt).contiguous();
  context_lens = context_lens.to(at::kInt).contiguous();
  auto out = at::empty_like(q);
  if (q.scalar_type() == at::kFloat) {
    decode<float>(q, k_cache, v_cache, block_tables, context_lens, out, scale);
  } else if (q.scalar_type() == at::kBFloat16) {
    decode<at::BFloat16>(q, k_cache, v_cache, block_tables, context_lens, out, scale);
  } else {
    TORCH_CHECK(false, "dtype ", q.scalar_type(), " is not supported (float32, bfloat16)");
  }
  return out;
}

}  // namespace epd
