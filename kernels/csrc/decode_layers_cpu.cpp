// A whole decode step's decoder layers in one call: the CPU's counterpart of a CUDA graph.
//
// A decode step of a 135M model on two cores is ~30 layers x a dozen small ops; run eagerly,
// each op pays Python, dispatcher and allocator costs that add up to more than the arithmetic.
// FusedDecoder holds every layer's weights and KV cache views once, and ``forward`` runs the
// Llama-family layer (Touvron et al. 2023; Qwen2's q/k/v bias, Qwen3's per-head q/k RMSNorm)
// over the step's decode tokens in C++: add+RMSNorm, q|k|v linear, RoPE, KV store, paged
// decode attention, o linear, add+RMSNorm, gate|up linear, SiLU*mul, down linear, and the
// final norm. Each op is this extension's kernel, rounding where the eager modules round.
// Two Python callables keep the engine's seams: ``layer_hook(l)`` right after layer l's K/V
// is stored (the KV connector's per-layer send), ``all_reduce(t)`` after each row-parallel
// linear at TP > 1 (epd.distributed.all_reduce, in place).
#include "cpu_kernels.h"

#include <pybind11/pybind11.h>

#include <string>
#include <vector>

namespace py = pybind11;

namespace epd {

namespace {
// The per-layer tensors, in the order the Python side passes them (epd.engine.cpu_decode).
enum Slot {
  kLn1, kQkvW, kQkvB, kQkvS, kQNorm, kKNorm, kOW, kOB, kOS, kLn2, kGuW, kGuB, kGuS, kDownW, kDownB, kDownS,
  kKCache, kVCache, kNumSlots
};

c10::optional<at::Tensor> opt(const at::Tensor& t) {
  return t.defined() ? c10::optional<at::Tensor>(t) : c10::nullopt;
}
}  // namespace

class FusedDecoder {
 public:
  // layers: kNumSlots tensors a layer (linear weights packed by pack_linear_weight);
  // out_features: the q|k|v, o, gate|up and down linears' output sizes.
  FusedDecoder(std::vector<std::vector<c10::optional<at::Tensor>>> layers, std::vector<int64_t> out_features,
               at::Tensor final_norm, at::Tensor cos, at::Tensor sin, int64_t num_heads, int64_t num_kv_heads,
               int64_t head_dim, double eps, double scale)
      : out_(std::move(out_features)), final_norm_(std::move(final_norm)), cos_(cos.contiguous()), sin_(sin.contiguous()), num_heads_(num_heads),
        num_kv_heads_(num_kv_heads), head_dim_(head_dim), eps_(eps), scale_(scale) {
    TORCH_CHECK(out_.size() == 4, "FusedDecoder: 4 output sizes (q|k|v, o, gate|up, down)");
    for (auto& l : layers) {
      TORCH_CHECK(static_cast<int>(l.size()) == kNumSlots, "FusedDecoder: ", kNumSlots, " tensors a layer, got ",
                  l.size());
      std::vector<at::Tensor> t(kNumSlots);
      for (int i = 0; i < kNumSlots; ++i)
        if (l[i].has_value()) t[i] = *l[i];
      for (int i : {kLn1, kQkvW, kOW, kLn2, kGuW, kDownW, kKCache, kVCache})
        TORCH_CHECK(t[i].defined(), "FusedDecoder: layer tensor ", i, " is required");
      layers_.push_back(std::move(t));
    }
  }

  // hidden: [T, H] the step's input embeddings (not modified); positions, slot_mapping: [T]
  // int64; block_tables [T, max_blocks] int32; context_lens [T] int32. Returns the final
  // norm's output [T, H] in hidden's dtype.
  at::Tensor forward(const at::Tensor& hidden, const at::Tensor& positions, const at::Tensor& slot_mapping,
                     const at::Tensor& block_tables, const at::Tensor& context_lens, const py::object& layer_hook,
                     const py::object& all_reduce) {
    const int64_t T = hidden.size(0);
    const int64_t q_size = num_heads_ * head_dim_, kv_size = num_kv_heads_ * head_dim_;
    const bool hook = !layer_hook.is_none(), reduce = !all_reduce.is_none();
    at::Tensor residual = hidden.contiguous().clone();
    at::Tensor h;
    for (size_t l = 0; l < layers_.size(); ++l) {
      const auto& w = layers_[l];
      const at::Tensor x = l == 0 ? add_rms_norm_cpu(residual, c10::nullopt, w[kLn1], eps_)
                                  : add_rms_norm_cpu(h, residual, w[kLn1], eps_);
      at::Tensor qkv = linear_cpu(x, w[kQkvW], out_[0], opt(w[kQkvB]), opt(w[kQkvS]));
      at::Tensor q = qkv.narrow(1, 0, q_size).view({T, num_heads_, head_dim_});
      at::Tensor k = qkv.narrow(1, q_size, kv_size).view({T, num_kv_heads_, head_dim_});
      const at::Tensor v = qkv.narrow(1, q_size + kv_size, kv_size).view({T, num_kv_heads_, head_dim_});
      if (w[kQNorm].defined()) {
        q = add_rms_norm_cpu(q.reshape({-1, head_dim_}), c10::nullopt, w[kQNorm], eps_).view(q.sizes());
        k = add_rms_norm_cpu(k.reshape({-1, head_dim_}), c10::nullopt, w[kKNorm], eps_).view(k.sizes());
      }
      rope_cpu(q, positions, cos_, sin_);
      rope_cpu(k, positions, cos_, sin_);
      at::Tensor kc = w[kKCache], vc = w[kVCache];
      store_kv_cpu(k, v, kc, vc, slot_mapping);
      if (hook) layer_hook(static_cast<int64_t>(l));
      const at::Tensor attn = paged_decode_attention_cpu(q, kc, vc, block_tables, context_lens, scale_);
      at::Tensor o = linear_cpu(attn.view({T, q_size}), w[kOW], out_[1], c10::nullopt, opt(w[kOS]));
      if (reduce) all_reduce(o);
      if (w[kOB].defined()) o.add_(w[kOB]);
      const at::Tensor x2 = add_rms_norm_cpu(o, residual, w[kLn2], eps_);
      const at::Tensor act = silu_mul_cpu(linear_cpu(x2, w[kGuW], out_[2], opt(w[kGuB]), opt(w[kGuS])));
      h = linear_cpu(act, w[kDownW], out_[3], c10::nullopt, opt(w[kDownS]));
      if (reduce) all_reduce(h);
      if (w[kDownB].defined()) h.add_(w[kDownB]);
    }
    return add_rms_norm_cpu(h, residual, final_norm_, eps_);
  }

 private:
  std::vector<std::vector<at::Tensor>> layers_;
  std::vector<int64_t> out_;
  at::Tensor final_norm_, cos_, sin_;
  int64_t num_heads_, num_kv_heads_, head_dim_;
  double eps_, scale_;
};

void bind_fused_decoder(py::module_& m) {
  py::class_<FusedDecoder>(m, "FusedDecoder")
      .def(py::init<std::vector<std::vector<c10::optional<at::Tensor>>>, std::vector<int64_t>, at::Tensor,
                    at::Tensor, at::Tensor, int64_t, int64_t, int64_t, double, double>())
      .def("forward", &FusedDecoder::forward);
}

}  // namespace epd
