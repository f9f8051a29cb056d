// Linear layers on packed weights, at the memory bound for the few rows of a decode step.
//
// y[m, n] = sum_k x[m, k] * w[n, k] (* scale[n]) (+ bias[n]). The weights are packed once, at
// load (pack_linear_weight), into column blocks of 16 output channels laid out as the
// vector units read them, as oneDNN and llama.cpp repack theirs:
//   * bf16 and int8: [N/16, K/2, 16, 2], a (column, pair of k) per 32-bit lane, for
//     AVX512-BF16's vdpbf16ps and AVX512-VNNI's vpdpwssd (two products summed into a lane);
//   * fp32: [N/16, K, 16].
// The kernel is a register-blocked GEMM micro-kernel: up to 4 rows of x by 4 blocks (64
// columns) of accumulators; each step broadcasts a k pair of each x row against 4 weight
// vectors. There are no horizontal sums; each weight byte is read once per 4 rows of x and
// a thread's panel of weights stays in L2 while it serves every row tile. Accumulation:
//   * bf16 weights: bf16 x, fp32 sums (vdpbf16ps);
//   * fp32: fp32 FMA;
//   * int8 weights (weight-only, one fp32 scale per output channel, as llama.cpp's q8_0
//     with a row-long block): each x row is quantized to int16 with its own scale
//     (max |x| / 32767, finer than bf16 for all but a row's smallest values), the int8
//     weights are sign-extended to int16 in registers (one instruction) and vpdpwssd sums
//     exact int32 products, flushed to fp32 before they could overflow; row and column
//     scales are applied at the end. So no weight is converted to floating point.
// Column blocks are split over torch's intra-op threads. Without AVX-512 (AVX512-BF16 for
// bf16, AVX512-VNNI for int8) a portable loop over the same layout computes the same sums,
// slower.
#include "cpu_kernels.h"

#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstring>

namespace epd {
namespace {

constexpr int64_t kLanes = 16;  // output columns per packed block
constexpr int64_t kMR = 4;      // rows of x per micro-kernel call
constexpr int64_t kNB = 4;      // column blocks per micro-kernel call
// weights are prefetched this many k pairs ahead in each block's stream (a block's panel is
// one stream a column block; with 4 blocks a call, the hardware prefetchers lag behind)
constexpr int64_t kPrefetchPairs = 16;

struct Epilogue {
  const float* scale;      // [N] or null
  const float* bias;       // [N] fp32 or null
  const float* row_scale;  // [M] or null (int16-quantized x)
};

// ---- portable: the same sums over the packed layout --------------------------------------
template <typename TX, typename TW>
void mk_generic(const TX* x, int64_t ldx, int mr, int64_t K, const TW* wp, int64_t blk_stride, int nb,
                float* acc /* [kMR][kNB * 16] */) {
  const bool pairs = !std::is_same_v<TW, float>;
  for (int i = 0; i < mr; ++i)
    for (int j = 0; j < nb; ++j)
      for (int64_t l = 0; l < kLanes; ++l) {
        float s = 0.f;
        for (int64_t k = 0; k < K; ++k) {
          const float xv = static_cast<float>(x[i * ldx + k]);
          const int64_t idx = pairs ? (k / 2) * 32 + l * 2 + (k % 2) : k * kLanes + l;
          s += xv * static_cast<float>(wp[j * blk_stride + idx]);
        }
        acc[i * kNB * kLanes + j * kLanes + l] = s;
      }
}

#if defined(__AVX512F__)
template <int MR, int NB>
void mk_f32(const float* x, int64_t ldx, int64_t K, const float* wp, int64_t blk_stride, float* out) {
  __m512 acc[MR][NB];
  for (int i = 0; i < MR; ++i)
    for (int j = 0; j < NB; ++j) acc[i][j] = _mm512_setzero_ps();
  for (int64_t k = 0; k < K; ++k) {
    __m512 w[NB];
    for (int j = 0; j < NB; ++j) w[j] = _mm512_loadu_ps(wp + j * blk_stride + k * kLanes);
    for (int i = 0; i < MR; ++i) {
      const __m512 xv = _mm512_set1_ps(x[i * ldx + k]);
      for (int j = 0; j < NB; ++j) acc[i][j] = _mm512_fmadd_ps(xv, w[j], acc[i][j]);
    }
  }
  for (int i = 0; i < MR; ++i)
    for (int j = 0; j < NB; ++j) _mm512_storeu_ps(out + i * kNB * kLanes + j * kLanes, acc[i][j]);
}
#endif

#if defined(__AVX512BF16__)
// the broadcast k pair (x[k], x[k + 1]) of one row; the pair past an odd K's end is (x[k], 0)
inline __m512i pair_at(const at::BFloat16* xr, int64_t k, int64_t K) {
  int32_t v;
  if (k + 1 < K) {
    std::memcpy(&v, xr + k, 4);
  } else {
    uint16_t lo;
    std::memcpy(&lo, xr + k, 2);
    v = lo;
  }
  return _mm512_set1_epi32(v);
}

template <int MR, int NB>
void mk_bf16(const at::BFloat16* x, int64_t ldx, int64_t K, const at::BFloat16* wp, int64_t blk_stride, float* out) {
  __m512 acc[MR][NB];
  for (int i = 0; i < MR; ++i)
    for (int j = 0; j < NB; ++j) acc[i][j] = _mm512_setzero_ps();
  const int64_t KP = (K + 1) / 2;
  for (int64_t p = 0; p < KP; ++p) {
    __m512bh w[NB];
    for (int j = 0; j < NB; ++j) {
      _mm_prefetch(reinterpret_cast<const char*>(wp + j * blk_stride + (p + kPrefetchPairs) * 32), _MM_HINT_T0);
      w[j] = (__m512bh)_mm512_loadu_si512(wp + j * blk_stride + p * 32);
    }
    for (int i = 0; i < MR; ++i) {
      const __m512bh xv = (__m512bh)pair_at(x + i * ldx, 2 * p, K);
      for (int j = 0; j < NB; ++j) acc[i][j] = _mm512_dpbf16_ps(acc[i][j], xv, w[j]);
    }
  }
  for (int i = 0; i < MR; ++i)
    for (int j = 0; j < NB; ++j) _mm512_storeu_ps(out + i * kNB * kLanes + j * kLanes, acc[i][j]);
}
#endif

#if defined(__AVX512VNNI__)
constexpr int64_t kFlushPairs = 128;  // |x| <= 32767, |w| <= 127: 128 pairs cannot overflow int32

// int8 weights times int16 x (each row quantized with its own scale): vpdpwssd sums two
// int16 products into each int32 lane; the int32 sums go to fp32 every kFlushPairs pairs.
template <int MR, int NB>
void mk_i8(const int16_t* x, int64_t ldx, int64_t K, const int8_t* wp, int64_t blk_stride, float* out) {
  for (int i = 0; i < MR; ++i)
    for (int j = 0; j < NB; ++j) _mm512_storeu_ps(out + i * kNB * kLanes + j * kLanes, _mm512_setzero_ps());
  const int64_t KP = (K + 1) / 2;  // x rows are zero-padded to an even width
  for (int64_t p0 = 0; p0 < KP; p0 += kFlushPairs) {
    const int64_t p1 = std::min(KP, p0 + kFlushPairs);
    __m512i acc[MR][NB];
    for (int i = 0; i < MR; ++i)
      for (int j = 0; j < NB; ++j) acc[i][j] = _mm512_setzero_si512();
    for (int64_t p = p0; p < p1; ++p) {
      __m512i w[NB];
      for (int j = 0; j < NB; ++j) {
        _mm_prefetch(reinterpret_cast<const char*>(wp + j * blk_stride + (p + 2 * kPrefetchPairs) * 32), _MM_HINT_T0);
        w[j] = _mm512_cvtepi8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(wp + j * blk_stride + p * 32)));
      }
      for (int i = 0; i < MR; ++i) {
        int32_t v;
        std::memcpy(&v, x + i * ldx + 2 * p, 4);
        const __m512i xv = _mm512_set1_epi32(v);
        for (int j = 0; j < NB; ++j) acc[i][j] = _mm512_dpwssd_epi32(acc[i][j], xv, w[j]);
      }
    }
    for (int i = 0; i < MR; ++i)
      for (int j = 0; j < NB; ++j) {
        float* o = out + i * kNB * kLanes + j * kLanes;
        _mm512_storeu_ps(o, _mm512_add_ps(_mm512_loadu_ps(o), _mm512_cvtepi32_ps(acc[i][j])));
      }
  }
}
#endif

// acc [mr][nb * 16] of rows m0.., columns n0..; as the widest kernel of this build.
template <typename TX, typename TW>
void micro(const TX* x, int64_t ldx, int mr, int64_t K, const TW* wp, int64_t blk_stride, int nb, float* acc) {
#define EPD_MK(FN)                                                                  \
  switch (mr * 8 + nb) {                                                                 \
    case 1 * 8 + 1: return FN<1, 1>(x, ldx, K, wp, blk_stride, acc);         \
    case 1 * 8 + 2: return FN<1, 2>(x, ldx, K, wp, blk_stride, acc);         \
    case 1 * 8 + 3: return FN<1, 3>(x, ldx, K, wp, blk_stride, acc);         \
    case 1 * 8 + 4: return FN<1, 4>(x, ldx, K, wp, blk_stride, acc);         \
    case 2 * 8 + 1: return FN<2, 1>(x, ldx, K, wp, blk_stride, acc);         \
    case 2 * 8 + 2: return FN<2, 2>(x, ldx, K, wp, blk_stride, acc);         \
    case 2 * 8 + 3: return FN<2, 3>(x, ldx, K, wp, blk_stride, acc);         \
    case 2 * 8 + 4: return FN<2, 4>(x, ldx, K, wp, blk_stride, acc);         \
    case 3 * 8 + 1: return FN<3, 1>(x, ldx, K, wp, blk_stride, acc);         \
    case 3 * 8 + 2: return FN<3, 2>(x, ldx, K, wp, blk_stride, acc);         \
    case 3 * 8 + 3: return FN<3, 3>(x, ldx, K, wp, blk_stride, acc);         \
    case 3 * 8 + 4: return FN<3, 4>(x, ldx, K, wp, blk_stride, acc);         \
    case 4 * 8 + 1: return FN<4, 1>(x, ldx, K, wp, blk_stride, acc);         \
    case 4 * 8 + 2: return FN<4, 2>(x, ldx, K, wp, blk_stride, acc);         \
    case 4 * 8 + 3: return FN<4, 3>(x, ldx, K, wp, blk_stride, acc);         \
    default: return FN<4, 4>(x, ldx, K, wp, blk_stride, acc);                \
  }
#if defined(__AVX512BF16__)
  if constexpr (std::is_same_v<TX, at::BFloat16> && std::is_same_v<TW, at::BFloat16>) {
    EPD_MK(mk_bf16)
  }
#endif
#if defined(__AVX512F__)
  if constexpr (std::is_same_v<TX, float> && std::is_same_v<TW, float>) {
    EPD_MK(mk_f32)
  }
#endif
#if defined(__AVX512VNNI__)
  if constexpr (std::is_same_v<TX, int16_t> && std::is_same_v<TW, int8_t>) {
    EPD_MK(mk_i8)
  }
#endif
#undef EPD_MK
  mk_generic<TX, TW>(x, ldx, mr, K, wp, blk_stride, nb, acc);
}

// y [M, N] (TY) = x [M, K] (TX) @ packed w (TW)
template <typename TX, typename TW, typename TY>
void gemm(const TX* x, int64_t ldx, int64_t M, int64_t K, const TW* wp, int64_t N, Epilogue ep, TY* y) {
  const int64_t nblk = (N + kLanes - 1) / kLanes;
  const int64_t blk_stride = std::is_same_v<TW, float> ? K * kLanes : ((K + 1) / 2) * 32;
  // a task is at least one micro-kernel's 4 blocks: even a decode step's smallest layer (a
  // few hundred KB of weights from DRAM) is worth both cores' memory bandwidth
  const int64_t grain = kNB;
  at::parallel_for(0, nblk, grain, [&](int64_t b0, int64_t b1) {
    alignas(64) float acc[kMR * kNB * kLanes];
    for (int64_t b = b0; b < b1; b += kNB) {
      const int nb = static_cast<int>(std::min(kNB, b1 - b));
      for (int64_t m0 = 0; m0 < M; m0 += kMR) {
        const int mr = static_cast<int>(std::min(kMR, M - m0));
        micro<TX, TW>(x + m0 * ldx, ldx, mr, K, wp + b * blk_stride, blk_stride, nb, acc);
        const int64_t n0 = b * kLanes, ncols = std::min<int64_t>(nb * kLanes, N - n0);
        for (int i = 0; i < mr; ++i) {
          const float* a = acc + i * kNB * kLanes;
          TY* yr = y + (m0 + i) * N + n0;
          for (int64_t c = 0; c < ncols; ++c) {
            float v = a[c];
            if (ep.row_scale) v *= ep.row_scale[m0 + i];
            if (ep.scale) v *= ep.scale[n0 + c];
            if (ep.bias) v += ep.bias[n0 + c];
            yr[c] = static_cast<TY>(v);
          }
        }
      }
    }
  });
}

// x [M, K] -> xq [M, ldx] int16 (zero tail) and scale [M] = max |x row| / 32767 (1 for a zero row)
template <typename TX>
void quantize_rows_i16(const TX* x, int64_t M, int64_t K, int16_t* xq, int64_t ldx, float* scale) {
  for (int64_t m = 0; m < M; ++m) {
    const TX* xr = x + m * K;
    float mx = 0.f;
    for (int64_t k = 0; k < K; ++k) mx = std::max(mx, std::abs(static_cast<float>(xr[k])));
    const float s = mx > 0.f ? mx / 32767.f : 1.f, inv = 1.f / s;
    int16_t* q = xq + m * ldx;
    for (int64_t k = 0; k < K; ++k) q[k] = static_cast<int16_t>(std::nearbyint(static_cast<float>(xr[k]) * inv));
    for (int64_t k = K; k < ldx; ++k) q[k] = 0;
    scale[m] = s;
  }
}

}  // namespace

at::Tensor pack_linear_weight(const at::Tensor& w) {
  TORCH_CHECK(w.dim() == 2, "pack_linear_weight: w must be [N, K], got ", w.sizes());
  const auto t = w.scalar_type();
  TORCH_CHECK(t == at::kFloat || t == at::kBFloat16 || t == at::kChar,
              "pack_linear_weight: float32, bfloat16 or int8 weights, got ", t);
  const int64_t N = w.size(0), K = w.size(1), nblk = (N + kLanes - 1) / kLanes;
  if (t == at::kFloat) {
    auto pad = at::zeros({nblk * kLanes, K}, w.options());
    pad.narrow(0, 0, N).copy_(w);
    return pad.view({nblk, kLanes, K}).permute({0, 2, 1}).contiguous();
  }
  const int64_t KP = (K + 1) / 2;
  auto pad = at::zeros({nblk * kLanes, KP * 2}, w.options());
  pad.narrow(0, 0, N).narrow(1, 0, K).copy_(w);
  return pad.view({nblk, kLanes, KP, 2}).permute({0, 2, 1, 3}).contiguous();
}

at::Tensor linear_cpu(const at::Tensor& x_in, const at::Tensor& packed, int64_t N,
                      const c10::optional<at::Tensor>& bias, const c10::optional<at::Tensor>& w_scale) {
  TORCH_CHECK(x_in.device().is_cpu() && packed.device().is_cpu(), "linear_cpu: CPU tensors only");
  TORCH_CHECK(x_in.dim() == 2, "linear_cpu: x must be [M, K], got ", x_in.sizes());
  const auto xt = x_in.scalar_type(), wt = packed.scalar_type();
  TORCH_CHECK(xt == at::kFloat || xt == at::kBFloat16, "linear_cpu: x must be float32 or bfloat16, got ", xt);
  const int64_t M = x_in.size(0), K = x_in.size(1), nblk = (N + kLanes - 1) / kLanes;
  TORCH_CHECK(packed.is_contiguous(), "linear_cpu: the packed weight must be contiguous");
  if (wt == at::kFloat) {
    TORCH_CHECK(packed.dim() == 3 && packed.size(0) == nblk && packed.size(1) == K && packed.size(2) == kLanes,
                "linear_cpu: fp32 packed weight must be [", nblk, ", ", K, ", 16], got ", packed.sizes());
    TORCH_CHECK(xt == at::kFloat, "linear_cpu: fp32 weights need float32 x, got ", xt);
  } else {
    TORCH_CHECK(wt == at::kBFloat16 || wt == at::kChar, "linear_cpu: packed weights are float32, bfloat16 or int8");
    TORCH_CHECK(packed.dim() == 4 && packed.size(0) == nblk && packed.size(1) == (K + 1) / 2 &&
                    packed.size(2) == kLanes && packed.size(3) == 2,
                "linear_cpu: packed weight must be [", nblk, ", ", (K + 1) / 2, ", 16, 2], got ", packed.sizes());
    TORCH_CHECK(wt == at::kChar || xt == at::kBFloat16, "linear_cpu: bf16 weights need bfloat16 x, got ", xt);
  }
  at::Tensor s, b;
  TORCH_CHECK(wt == at::kChar || !(w_scale.has_value() && w_scale->defined()),
              "linear_cpu: w_scale is for int8 weights only");
  if (wt == at::kChar) {
    TORCH_CHECK(w_scale.has_value() && w_scale->numel() == N && w_scale->scalar_type() == at::kFloat,
                "linear_cpu: int8 weights need w_scale [N] float32");
    s = w_scale->contiguous();
  }
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->numel() == N, "linear_cpu: bias has ", bias->numel(), " elements, the layer ", N, " outputs");
    b = bias->to(at::kFloat).contiguous();
  }
  auto y = at::empty({M, N}, x_in.options());
  if (M == 0) return y;
  Epilogue ep{s.defined() ? s.data_ptr<float>() : nullptr, b.defined() ? b.data_ptr<float>() : nullptr, nullptr};
  if (wt == at::kFloat) {
    const at::Tensor x = x_in.contiguous();
    gemm<float, float, float>(x.data_ptr<float>(), K, M, K, packed.data_ptr<float>(), N, ep, y.data_ptr<float>());
    return y;
  }
  if (wt == at::kChar) {
    // x rows as int16 with one scale each (max |x| / 32767: finer than bf16 for all but the
    // row's smallest values), zero-padded to an even width
    const int64_t ldx = K + (K & 1);
    at::Tensor xq = at::empty({M, ldx}, x_in.options().dtype(at::kShort));
    at::Tensor rs = at::empty({M}, x_in.options().dtype(at::kFloat));
    const at::Tensor x = x_in.contiguous();
    if (xt == at::kFloat) {
      quantize_rows_i16(x.data_ptr<float>(), M, K, xq.data_ptr<int16_t>(), ldx, rs.data_ptr<float>());
    } else {
      quantize_rows_i16(x.data_ptr<at::BFloat16>(), M, K, xq.data_ptr<int16_t>(), ldx, rs.data_ptr<float>());
    }
    ep.row_scale = rs.data_ptr<float>();
    const auto* xp = xq.data_ptr<int16_t>();
    if (xt == at::kFloat) {
      gemm<int16_t, int8_t, float>(xp, ldx, M, K, packed.data_ptr<int8_t>(), N, ep, y.data_ptr<float>());
    } else {
      gemm<int16_t, int8_t, at::BFloat16>(xp, ldx, M, K, packed.data_ptr<int8_t>(), N, ep,
                                          y.data_ptr<at::BFloat16>());
    }
    return y;
  }
  const at::Tensor x = x_in.contiguous();
  gemm<at::BFloat16, at::BFloat16, at::BFloat16>(x.data_ptr<at::BFloat16>(), K, M, K, packed.data_ptr<at::BFloat16>(),
                                                 N, ep, y.data_ptr<at::BFloat16>());
  return y;
}

}  // namespace epd
