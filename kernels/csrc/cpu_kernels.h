// The CPU kernels of epd's one extension (``epd.kernels.cpu_extension``), declared for the
// sources that call one another: the fused decode (decode_layers_cpu.cpp) runs the linear,
// element-wise and attention kernels of the other files.
#pragma once
#include <torch/extension.h>

namespace epd {

// w [N, K] fp32/bf16/int8 -> its packed layout (linear_cpu.cpp): [N/16, K, 16] fp32,
// [N/16, K/2, 16, 2] bf16 and int8 (N and K padded with zeros).
at::Tensor pack_linear_weight(const at::Tensor& w);
// y = x @ w.T (* w_scale) (+ bias). x [M, K] fp32/bf16; packed (pack_linear_weight) of w
// [N, K]: fp32 (fp32 x), bf16 (bf16 x) or int8 with w_scale [N] fp32. Returns [M, N] in x's dtype.
at::Tensor linear_cpu(const at::Tensor& x, const at::Tensor& packed, int64_t N,
                      const c10::optional<at::Tensor>& bias, const c10::optional<at::Tensor>& w_scale);

// Paged decode attention (paged_decode_cpu.cpp). q [S, H, D]; caches [B, bs, Hkv, D].
at::Tensor paged_decode_attention_cpu(at::Tensor q, at::Tensor k_cache, at::Tensor v_cache,
                                      at::Tensor block_tables, at::Tensor context_lens, double scale);

// Element-wise kernels (elementwise_cpu.cpp), rounding where the eager torch ops round.
// residual (if defined) += x in place; returns rms_norm(residual or x) * w.  x [T, H].
at::Tensor add_rms_norm_cpu(const at::Tensor& x, const c10::optional<at::Tensor>& residual,
                            const at::Tensor& w, double eps);
// In place: rotate-half RoPE of x [T, heads, D] at positions [T] from cos/sin [P, D] fp32.
void rope_cpu(at::Tensor& x, const at::Tensor& positions, const at::Tensor& cos, const at::Tensor& sin);
// silu(x[:, :I]) * x[:, I:] -> [T, I].
at::Tensor silu_mul_cpu(const at::Tensor& x);
// k_cache.view(-1, Hkv, D)[slot_mapping[t]] = k[t] (and v); slots < 0 are skipped.
void store_kv_cpu(const at::Tensor& k, const at::Tensor& v, at::Tensor& k_cache, at::Tensor& v_cache,
                  const at::Tensor& slot_mapping);

}  // namespace epd
