// Linear layers at the memory bound for the few rows of a decode step (GEMV / skinny GEMM).
//
// y[m, n] = sum_k x[m, k] * w[n, k] (+ bias[n]), weights row-major [N, K] as torch keeps them.
// Output rows are split over torch's intra-op threads (at::parallel_for); each thread walks
// its weight rows once, in tiles of kNB rows, and multiplies every tile by all M input rows
// (in tiles of up to kMB rows) while the tile is in L1, so the weights stream from memory
// once per call whatever M is. Accumulation is fp32:
//   * bf16: AVX512-BF16 dot products (vdpbf16ps) of bf16 x and bf16 w, as oneDNN and
//     llama.cpp do on this hardware;
//   * fp32: AVX-512 FMA;
//   * int8 weights (per output channel scale, weight-only, as llama.cpp's q8_0 with one
//     scale a row): each 16-weight chunk is widened to fp32 and FMA'd with fp32 x, and the
//     row's dot product is scaled once at the end.
// Without AVX-512 (or AVX512-BF16) a portable loop computes the same sums, slower.
#include "cpu_kernels.h"

#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <vector>

namespace epd {
namespace {

constexpr int64_t kNB = 4;  // weight rows per tile
constexpr int64_t kMB = 4;  // input rows per tile

inline float to_f(float v) { return v; }
inline float to_f(at::BFloat16 v) { return static_cast<float>(v); }

// ---- portable tile: acc[i * NB + j] = dot(x row i, w row j) -----------------------------
template <typename TX, typename TW>
void tile_generic(const TX* x, int64_t ldx, int64_t mb, const TW* w, int64_t ldw, int64_t nb, int64_t K,
                  float* acc) {
  for (int64_t i = 0; i < mb; ++i)
    for (int64_t j = 0; j < nb; ++j) {
      const TX* xr = x + i * ldx;
      const TW* wr = w + j * ldw;
      float s = 0.f;
      for (int64_t k = 0; k < K; ++k) s += to_f(xr[k]) * static_cast<float>(wr[k]);
      acc[i * kNB + j] = s;
    }
}

#if defined(__AVX512F__)
inline __mmask16 mask16(int64_t n) { return n >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << n) - 1); }

template <int MB, int NB>
void tile_f32(const float* x, int64_t ldx, const float* w, int64_t ldw, int64_t K, float* acc_out) {
  __m512 acc[MB][NB];
  for (int i = 0; i < MB; ++i)
    for (int j = 0; j < NB; ++j) acc[i][j] = _mm512_setzero_ps();
  for (int64_t k = 0; k < K; k += 16) {
    const __mmask16 m = mask16(K - k);
    __m512 wv[NB];
    for (int j = 0; j < NB; ++j) wv[j] = _mm512_maskz_loadu_ps(m, w + j * ldw + k);
    for (int i = 0; i < MB; ++i) {
      const __m512 xv = _mm512_maskz_loadu_ps(m, x + i * ldx + k);
      for (int j = 0; j < NB; ++j) acc[i][j] = _mm512_fmadd_ps(xv, wv[j], acc[i][j]);
    }
  }
  for (int i = 0; i < MB; ++i)
    for (int j = 0; j < NB; ++j) acc_out[i * kNB + j] = _mm512_reduce_add_ps(acc[i][j]);
}

template <int MB, int NB>
void tile_i8(const float* x, int64_t ldx, const int8_t* w, int64_t ldw, int64_t K, float* acc_out) {
  __m512 acc[MB][NB];
  for (int i = 0; i < MB; ++i)
    for (int j = 0; j < NB; ++j) acc[i][j] = _mm512_setzero_ps();
  for (int64_t k = 0; k < K; k += 16) {
    const __mmask16 m = mask16(K - k);
    __m512 wv[NB];
    for (int j = 0; j < NB; ++j)
      wv[j] = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_maskz_loadu_epi8(m, w + j * ldw + k)));
    for (int i = 0; i < MB; ++i) {
      const __m512 xv = _mm512_maskz_loadu_ps(m, x + i * ldx + k);
      for (int j = 0; j < NB; ++j) acc[i][j] = _mm512_fmadd_ps(xv, wv[j], acc[i][j]);
    }
  }
  for (int i = 0; i < MB; ++i)
    for (int j = 0; j < NB; ++j) acc_out[i * kNB + j] = _mm512_reduce_add_ps(acc[i][j]);
}
#endif

#if defined(__AVX512BF16__)
inline __mmask32 mask32(int64_t n) { return n >= 32 ? 0xFFFFFFFFu : static_cast<__mmask32>((1u << n) - 1); }

template <int MB, int NB>
void tile_bf16(const at::BFloat16* x, int64_t ldx, const at::BFloat16* w, int64_t ldw, int64_t K,
               float* acc_out) {
  __m512 acc[MB][NB];
  for (int i = 0; i < MB; ++i)
    for (int j = 0; j < NB; ++j) acc[i][j] = _mm512_setzero_ps();
  for (int64_t k = 0; k < K; k += 32) {
    const __mmask32 m = mask32(K - k);
    __m512bh wv[NB];
    for (int j = 0; j < NB; ++j) wv[j] = (__m512bh)_mm512_maskz_loadu_epi16(m, w + j * ldw + k);
    for (int i = 0; i < MB; ++i) {
      const __m512bh xv = (__m512bh)_mm512_maskz_loadu_epi16(m, x + i * ldx + k);
      for (int j = 0; j < NB; ++j) acc[i][j] = _mm512_dpbf16_ps(acc[i][j], xv, wv[j]);
    }
  }
  for (int i = 0; i < MB; ++i)
    for (int j = 0; j < NB; ++j) acc_out[i * kNB + j] = _mm512_reduce_add_ps(acc[i][j]);
}
#endif

// One (mb x nb) tile, dispatched to the widest kernel this build has.
template <typename TX, typename TW>
void tile(const TX* x, int64_t ldx, int64_t mb, const TW* w, int64_t ldw, int64_t nb, int64_t K, float* acc) {
#define EPD_TILE(FN)                                                       \
  if (nb == kNB) {                                                         \
    switch (mb) {                                                          \
      case 1: return FN<1, kNB>(x, ldx, w, ldw, K, acc);                   \
      case 2: return FN<2, kNB>(x, ldx, w, ldw, K, acc);                   \
      case 3: return FN<3, kNB>(x, ldx, w, ldw, K, acc);                   \
      default: return FN<4, kNB>(x, ldx, w, ldw, K, acc);                  \
    }                                                                      \
  }                                                                        \
  for (int64_t j = 0; j < nb; ++j)                                         \
    for (int64_t i = 0; i < mb; ++i) {                                     \
      float one[kNB * kMB];                                                \
      FN<1, 1>(x + i * ldx, ldx, w + j * ldw, ldw, K, one);                \
      acc[i * kNB + j] = one[0];                                           \
    }                                                                      \
  return;
#if defined(__AVX512BF16__)
  if constexpr (std::is_same_v<TX, at::BFloat16> && std::is_same_v<TW, at::BFloat16>) {
    EPD_TILE(tile_bf16)
  }
#endif
#if defined(__AVX512F__)
  if constexpr (std::is_same_v<TX, float> && std::is_same_v<TW, float>) {
    EPD_TILE(tile_f32)
  }
  if constexpr (std::is_same_v<TX, float> && std::is_same_v<TW, int8_t>) {
    EPD_TILE(tile_i8)
  }
#endif
#undef EPD_TILE
  tile_generic(x, ldx, mb, w, ldw, nb, K, acc);
}

// y [M, N] (TY) = x [M, K] (TX) @ w [N, K] (TW).T * scale[n] + bias[n]
template <typename TX, typename TW, typename TY>
void gemm(const TX* x, int64_t M, int64_t K, const TW* w, int64_t N, const float* scale, const TY* bias, TY* y) {
  const int64_t tiles = (N + kNB - 1) / kNB;
  at::parallel_for(0, tiles, 1, [&](int64_t begin, int64_t end) {
    float acc[kMB * kNB];
    for (int64_t t = begin; t < end; ++t) {
      const int64_t n0 = t * kNB, nb = std::min(kNB, N - n0);
      for (int64_t m0 = 0; m0 < M; m0 += kMB) {
        const int64_t mb = std::min(kMB, M - m0);
        tile<TX, TW>(x + m0 * K, K, mb, w + n0 * K, K, nb, K, acc);
        for (int64_t i = 0; i < mb; ++i)
          for (int64_t j = 0; j < nb; ++j) {
            float v = acc[i * kNB + j];
            if (scale) v *= scale[n0 + j];
            if (bias) v += static_cast<float>(bias[n0 + j]);
            y[(m0 + i) * N + n0 + j] = static_cast<TY>(v);
          }
      }
    }
  });
}

}  // namespace

at::Tensor linear_cpu(const at::Tensor& x_in, const at::Tensor& w, const c10::optional<at::Tensor>& bias,
                      const c10::optional<at::Tensor>& w_scale) {
  TORCH_CHECK(x_in.device().is_cpu() && w.device().is_cpu(), "linear_cpu: CPU tensors only");
  TORCH_CHECK(x_in.dim() == 2 && w.dim() == 2 && x_in.size(1) == w.size(1), "linear_cpu: x [M, K] and w [N, K], got ",
              x_in.sizes(), " and ", w.sizes());
  TORCH_CHECK(w.is_contiguous(), "linear_cpu: w must be contiguous");
  const auto xt = x_in.scalar_type();
  TORCH_CHECK(xt == at::kFloat || xt == at::kBFloat16, "linear_cpu: x must be float32 or bfloat16, got ", xt);
  const at::Tensor x = x_in.contiguous();
  const int64_t M = x.size(0), K = x.size(1), N = w.size(0);
  at::Tensor b;
  if (bias.has_value() && bias->defined()) {
    b = bias->to(xt).contiguous();
    TORCH_CHECK(b.numel() == N, "linear_cpu: bias has ", b.numel(), " elements, w has ", N, " rows");
  }
  auto y = at::empty({M, N}, x.options());
  if (M == 0) return y;
  if (w.scalar_type() == at::kChar) {
    TORCH_CHECK(w_scale.has_value() && w_scale->numel() == N && w_scale->scalar_type() == at::kFloat,
                "linear_cpu: int8 weights need w_scale [N] float32");
    const at::Tensor xf = x.to(at::kFloat).contiguous();
    const at::Tensor s = w_scale->contiguous();
    if (xt == at::kFloat) {
      gemm<float, int8_t, float>(xf.data_ptr<float>(), M, K, w.data_ptr<int8_t>(), N, s.data_ptr<float>(),
                                 b.defined() ? b.data_ptr<float>() : nullptr, y.data_ptr<float>());
    } else {
      gemm<float, int8_t, at::BFloat16>(xf.data_ptr<float>(), M, K, w.data_ptr<int8_t>(), N, s.data_ptr<float>(),
                                        b.defined() ? b.data_ptr<at::BFloat16>() : nullptr,
                                        y.data_ptr<at::BFloat16>());
    }
    return y;
  }
  TORCH_CHECK(w.scalar_type() == xt, "linear_cpu: w (", w.scalar_type(), ") must be x's dtype (", xt, ") or int8");
  if (xt == at::kFloat) {
    gemm<float, float, float>(x.data_ptr<float>(), M, K, w.data_ptr<float>(), N, nullptr,
                              b.defined() ? b.data_ptr<float>() : nullptr, y.data_ptr<float>());
  } else {
    gemm<at::BFloat16, at::BFloat16, at::BFloat16>(x.data_ptr<at::BFloat16>(), M, K, w.data_ptr<at::BFloat16>(), N,
                                                   nullptr, b.defined() ? b.data_ptr<at::BFloat16>() : nullptr,
                                                   y.data_ptr<at::BFloat16>());
  }
  return y;
}

}  // namespace epd
