// The Python module of epd's CPU kernels (built by epd.kernels.cpu_extension).
#include "cpu_kernels.h"

namespace epd {
void bind_fused_decoder(pybind11::module_& m);
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_decode_attention_cpu", &epd::paged_decode_attention_cpu,
        "Paged decode attention over the paged KV cache, in place (CPU, fp32/bf16)");
  m.def("pack_linear_weight", &epd::pack_linear_weight, "[N, K] -> the packed layout of linear()");
  m.def("linear", &epd::linear_cpu, "y = x @ w.T (* w_scale) (+ bias) on a packed weight",
        pybind11::arg("x"), pybind11::arg("packed"), pybind11::arg("n"), pybind11::arg("bias") = pybind11::none(),
        pybind11::arg("w_scale") = pybind11::none());
  m.def("add_rms_norm", &epd::add_rms_norm_cpu, "RMSNorm of x (+ residual, updated in place)");
  m.def("rope", &epd::rope_cpu, "rotate-half RoPE, in place");
  m.def("silu_mul", &epd::silu_mul_cpu, "silu(gate) * up of a fused gate|up row");
  m.def("store_kv", &epd::store_kv_cpu, "slot-mapped store of k / v rows into the paged caches");
  epd::bind_fused_decoder(m);
}
