// The element-wise ops of a decoder layer on the CPU, one pass each, rounding to the model's
// dtype exactly where the eager torch modules round (epd/layers: RMSNorm, RotaryEmbedding,
// SiluAndMul), so bf16 results track the eager path's and fp32 results are the same sums.
// Rows are split over torch's intra-op threads when there are enough of them.
#include "cpu_kernels.h"

#include <ATen/Parallel.h>

#include <cmath>

namespace epd {
namespace {

template <typename T>
inline T rnd(float v) { return static_cast<T>(v); }  // round to T (bf16: nearest-even)

inline int64_t grain_rows(int64_t row_elems) { return std::max<int64_t>(1, 32768 / std::max<int64_t>(1, row_elems)); }

template <typename T>
void add_rms_norm(const T* x, T* res, const T* w, T* y, int64_t rows, int64_t H, float eps) {
  at::parallel_for(0, rows, grain_rows(H), [&](int64_t b, int64_t e) {
    for (int64_t r = b; r < e; ++r) {
      const T* xr = x + r * H;
      T* yr = y + r * H;
      T* rr = res ? res + r * H : nullptr;
      float ss = 0.f;
      for (int64_t i = 0; i < H; ++i) {
        float v = static_cast<float>(xr[i]);
        if (rr) {  // residual = residual + x, in the model's dtype
          const T s = rnd<T>(static_cast<float>(rr[i]) + v);
          rr[i] = s;
          v = static_cast<float>(s);
        }
        ss += v * v;
      }
      const float inv = 1.f / std::sqrt(ss / static_cast<float>(H) + eps);
      const T* src = rr ? rr : xr;
      for (int64_t i = 0; i < H; ++i) {  // weight * (x * rsqrt(...)).to(dtype)
        const T n = rnd<T>(static_cast<float>(src[i]) * inv);
        yr[i] = rnd<T>(static_cast<float>(w[i]) * static_cast<float>(n));
      }
    }
  });
}

template <typename T>
void rope(T* x, int64_t T_, int64_t heads, int64_t D, int64_t row_stride, const int64_t* pos, const float* cos,
          const float* sin, int64_t P) {
  const int64_t half = D / 2;
  for (int64_t t = 0; t < T_; ++t) {
    const int64_t p = pos[t];
    TORCH_CHECK(p >= 0 && p < P, "rope_cpu: position ", p, " is outside the table's ", P, " positions");
    const float* c = cos + p * D;
    const float* s = sin + p * D;
    for (int64_t h = 0; h < heads; ++h) {
      T* v = x + t * row_stride + h * D;
      for (int64_t i = 0; i < half; ++i) {
        const float a = static_cast<float>(v[i]), b = static_cast<float>(v[i + half]);
        // q * cos + rotate_half(q) * sin, each product and the sum in the model's dtype
        const float c1 = static_cast<float>(rnd<T>(c[i])), s1 = static_cast<float>(rnd<T>(s[i]));
        const float c2 = static_cast<float>(rnd<T>(c[i + half])), s2 = static_cast<float>(rnd<T>(s[i + half]));
        const float lo = static_cast<float>(rnd<T>(a * c1)) + static_cast<float>(rnd<T>(-b * s1));
        const float hi = static_cast<float>(rnd<T>(b * c2)) + static_cast<float>(rnd<T>(a * s2));
        v[i] = rnd<T>(lo);
        v[i + half] = rnd<T>(hi);
      }
    }
  }
}

template <typename T>
void silu_mul(const T* x, T* y, int64_t rows, int64_t I) {
  at::parallel_for(0, rows, grain_rows(I), [&](int64_t b, int64_t e) {
    for (int64_t r = b; r < e; ++r) {
      const T* g = x + r * 2 * I;
      const T* u = g + I;
      T* yr = y + r * I;
      for (int64_t i = 0; i < I; ++i) {
        const float gv = static_cast<float>(g[i]);
        const T act = rnd<T>(gv / (1.f + std::exp(-gv)));
        yr[i] = rnd<T>(static_cast<float>(act) * static_cast<float>(u[i]));
      }
    }
  });
}

template <typename F>
void dispatch(at::ScalarType t, const char* op, F&& f) {
  if (t == at::kFloat) {
    f(float{});
  } else if (t == at::kBFloat16) {
    f(at::BFloat16{});
  } else {
    TORCH_CHECK(false, op, ": dtype ", t, " is not supported (float32, bfloat16)");
  }
}

}  // namespace

at::Tensor add_rms_norm_cpu(const at::Tensor& x_in, const c10::optional<at::Tensor>& residual, const at::Tensor& w,
                            double eps) {
  TORCH_CHECK(x_in.dim() == 2 && w.dim() == 1 && w.numel() == x_in.size(1) && w.is_contiguous() &&
                  w.scalar_type() == x_in.scalar_type(),
              "add_rms_norm_cpu: x [T, H] and a contiguous w [H] of x's dtype");
  const at::Tensor x = x_in.contiguous();
  at::Tensor y = at::empty_like(x);
  const bool has_res = residual.has_value() && residual->defined();
  if (has_res)
    TORCH_CHECK(residual->is_contiguous() && residual->sizes() == x.sizes() &&
                    residual->scalar_type() == x.scalar_type(),
                "add_rms_norm_cpu: residual must be contiguous, x's shape and dtype");
  dispatch(x.scalar_type(), "add_rms_norm_cpu", [&](auto tag) {
    using T = decltype(tag);
    add_rms_norm<T>(x.data_ptr<T>(), has_res ? residual->data_ptr<T>() : nullptr, w.data_ptr<T>(), y.data_ptr<T>(),
                    x.size(0), x.size(1), static_cast<float>(eps));
  });
  return y;
}

void rope_cpu(at::Tensor& x, const at::Tensor& positions, const at::Tensor& cos, const at::Tensor& sin) {
  TORCH_CHECK(x.dim() == 3 && x.stride(2) == 1 && x.stride(1) == x.size(2), "rope_cpu: x [T, heads, D], rows dense");
  TORCH_CHECK(cos.scalar_type() == at::kFloat && sin.scalar_type() == at::kFloat && cos.is_contiguous() &&
                  sin.is_contiguous() && cos.dim() == 2 && sin.sizes() == cos.sizes() && cos.size(1) == x.size(2),
              "rope_cpu: cos / sin [P, D] float32, contiguous, of one shape");
  TORCH_CHECK(positions.scalar_type() == at::kLong && positions.numel() == x.size(0), "rope_cpu: positions [T] int64");
  const at::Tensor pos = positions.contiguous();
  dispatch(x.scalar_type(), "rope_cpu", [&](auto tag) {
    using T = decltype(tag);
    rope<T>(x.data_ptr<T>(), x.size(0), x.size(1), x.size(2), x.stride(0), pos.data_ptr<int64_t>(),
            cos.data_ptr<float>(), sin.data_ptr<float>(), cos.size(0));
  });
}

at::Tensor silu_mul_cpu(const at::Tensor& x_in) {
  TORCH_CHECK(x_in.dim() == 2 && x_in.size(1) % 2 == 0, "silu_mul_cpu: x [T, 2 * I]");
  const at::Tensor x = x_in.contiguous();
  const int64_t I = x.size(1) / 2;
  at::Tensor y = at::empty({x.size(0), I}, x.options());
  dispatch(x.scalar_type(), "silu_mul_cpu", [&](auto tag) {
    using T = decltype(tag);
    silu_mul<T>(x.data_ptr<T>(), y.data_ptr<T>(), x.size(0), I);
  });
  return y;
}

void store_kv_cpu(const at::Tensor& k, const at::Tensor& v, at::Tensor& k_cache, at::Tensor& v_cache,
                  const at::Tensor& slot_mapping) {
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous(), "store_kv_cpu: the caches must be contiguous");
  TORCH_CHECK(k.scalar_type() == k_cache.scalar_type() && v.scalar_type() == k.scalar_type() &&
                  v_cache.scalar_type() == k.scalar_type(),
              "store_kv_cpu: k / v must have the cache's dtype");
  TORCH_CHECK(k.dim() == 3 && v.sizes() == k.sizes() && k_cache.dim() == 4 && v_cache.sizes() == k_cache.sizes(),
              "store_kv_cpu: k and v [T, Hkv, D] of one shape, k_cache and v_cache of one shape");
  TORCH_CHECK(slot_mapping.dim() == 1 && slot_mapping.numel() == k.size(0),
              "store_kv_cpu: slot_mapping must be [T] = [", k.size(0), "]");
  const int64_t T = k.size(0), row = k.size(1) * k.size(2);
  TORCH_CHECK(k_cache.size(2) * k_cache.size(3) == row && k.stride(1) == k.size(2) && k.stride(2) == 1 &&
                  v.stride(1) == v.size(2) && v.stride(2) == 1,
              "store_kv_cpu: k / v [T, Hkv, D] with dense rows, the cache's Hkv and D");
  const int64_t slots = k_cache.size(0) * k_cache.size(1);
  const at::Tensor sm = slot_mapping.to(at::kLong).contiguous();
  const int64_t* s = sm.data_ptr<int64_t>();
  const int64_t bytes = row * k.element_size();
  auto* kc = static_cast<char*>(k_cache.data_ptr());
  auto* vc = static_cast<char*>(v_cache.data_ptr());
  const auto* kp = static_cast<const char*>(k.data_ptr());
  const auto* vp = static_cast<const char*>(v.data_ptr());
  for (int64_t t = 0; t < T; ++t) {
    const int64_t slot = s[t];
    if (slot < 0) continue;  // a padded row
    TORCH_CHECK(slot < slots, "store_kv_cpu: slot ", slot, " is outside the cache's ", slots, " slots");
    std::memcpy(kc + slot * bytes, kp + t * k.stride(0) * k.element_size(), bytes);
    std::memcpy(vc + slot * bytes, vp + t * v.stride(0) * v.element_size(), bytes);
  }
}

}  // namespace epd
