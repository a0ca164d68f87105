// The Python module of the CPU kernels: every binding, and the one file of engine/csrc that includes pybind11.
//
// Not through <torch/extension.h>, which adds all of libtorch's C++ API (modules, optimisers, autograd) to pybind11
// and torch's tensor casters: on a 2-core Zen 4 it costs the compiler ~26 s per file against ~8 s for
// torch/csrc/utils/pybind.h (the casters) and ~2-4 s for the ATen headers the kernels' own files include. When
// every file included it, the build took 110 s; now ~30.

#include <torch/csrc/utils/pybind.h>

#include "cpu_ops.h"
#include "decode_stack.h"

namespace {

namespace py = pybind11;

void bind_decode_stack(py::module& m) {
  using namespace tandem_stack;
  py::class_<StackLinear>(m, "StackLinear", "a packed matrix of a DecodeStack")
      .def(py::init<at::Tensor, int64_t, c10::optional<at::Tensor>, c10::optional<at::Tensor>, int64_t>(),
           py::arg("data"), py::arg("rows"), py::arg("bias"), py::arg("next"), py::arg("next_rows"));
  py::class_<StackLayer>(m, "StackLayer", "one decoder layer of a DecodeStack")
      .def(py::init<at::Tensor, StackLinear, StackLinear, at::Tensor, StackLinear, StackLinear>(),
           py::arg("input_norm"), py::arg("qkv"), py::arg("o_proj"), py::arg("post_norm"), py::arg("gate_up"),
           py::arg("down"));
  py::class_<DecodeStack>(m, "DecodeStack", "a decoder's layers for an all-decode step in one call, GIL released")
      .def(py::init<std::vector<StackLayer>, at::Tensor, double, int64_t, int64_t, int64_t>(), py::arg("layers"),
           py::arg("final_norm"), py::arg("eps"), py::arg("num_heads"), py::arg("num_kv_heads"), py::arg("head_dim"))
      .def("forward", &DecodeStack::forward, py::call_guard<py::gil_scoped_release>(), py::arg("x"),
           py::arg("positions"), py::arg("cos"), py::arg("sin"), py::arg("caches"), py::arg("slots"),
           py::arg("block_table"), py::arg("context_lens"), py::arg("block_size"), py::arg("scale"))
      .def("__len__", &DecodeStack::num_layers);
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
#if defined(__AVX512BF16__) || defined(__AMX_BF16__)
  m.attr("NATIVE_BF16") = true;
#else
  m.attr("NATIVE_BF16") = false;
#endif
  // Whether the kernels use AVX512_BF16's dot products (cpu_ops.cpp's HAVE_DPBF16, packed_linear.cpp's
  // DOT_PRODUCTS_BF16): the same compile-time test.
#if defined(__AVX512BF16__)
  m.attr("DOT_BF16") = true;
#else
  m.attr("DOT_BF16") = false;
#endif
  // The widest vectors the kernels were compiled for (TANDEM_CPU_MARCH may name an older CPU than this one).
#if defined(__AVX512F__)
  m.attr("SIMD") = "avx512";
#elif defined(__AVX2__) && defined(__FMA__)
  m.attr("SIMD") = "avx2";
#else
  m.attr("SIMD") = "portable";
#endif
  // The matmuls and attention let go of the GIL while they run (as torch's own ops do): a worker's gRPC loop and its
  // KV connector's threads share the process with the engine's thread, and while a kernel held the GIL they waited
  // for it to return, a 1,024-token prefill's asyncio loop up to 11-12 ms at a time (0.3-4 ms after; a 2-core Zen 4).
  // The element-wise ops (norms, RoPE, the cache writes, argmax) take microseconds and keep it. DecodeStack.forward
  // lets go of it for the whole step.
  const auto no_gil = py::call_guard<py::gil_scoped_release>();
  m.def("linear", &linear, "x W^T (+ b), float32 accumulation, each weight row read once per 4 rows of x", no_gil);
  m.def("rms_norm", &rms_norm, "RMSNorm of [T, H]");
  m.def("add_rms_norm_", &add_rms_norm_, "residual += delta, then RMSNorm of the residual");
  m.def("silu_mul", &silu_mul, "silu(gate) * up of a fused [T, 2I] projection");
  m.def("rope_", &rope_, "rotate-half RoPE in place on the leading heads of each row");
  m.def("write_kv_", &write_kv_, "k/v of new tokens into their cache slots");
  m.attr("QUANT_INT_DOT") = qlinear_int_dot();
  m.attr("QUANT_AMX") = qlinear_amx();
  m.def("qlinear", &qlinear, "x W^T (+ b) for block-quantized W: int8 x per 32-block, or bfloat16 tiles (AMX)",
        no_gil);
  m.def("packed_linear_supported", &packed_linear_supported, "whether this CPU has a packed kernel for the dtype");
  m.def("pack_linear_weight", &pack_linear_weight, "an [N, K] weight as the column panels of packed_linear");
  m.def("packed_linear", &packed_linear, "x W^T (+ b) on a packed weight, register-blocked, no reductions", no_gil,
        py::arg("x"), py::arg("packed"), py::arg("N"), py::arg("bias") = py::none(), py::arg("next") = py::none(),
        py::arg("next_N") = 0, py::arg("float_out") = false);
  m.def("packed_linear_silu", &packed_linear_silu, "silu(x G^T) * (x U^T) on a gate_up weight in half-panels", no_gil,
        py::arg("x"), py::arg("packed"), py::arg("I"), py::arg("next") = py::none(), py::arg("next_N") = 0);
  m.def("prefill_attention_supported", &prefill_attention_supported, "whether prefill_attention serves q's dtype and D");
  m.def("prefill_attention", &prefill_attention, "causal GQA attention of the last L of C positions, packed panels",
        no_gil);
  m.def("packed_silu_half_panel", &packed_silu_half_panel, "columns of G (then of U) per panel of packed_linear_silu");
  m.def("set_widened_bf16", &set_widened_bf16, "packed_linear's bfloat16 widened to float32 FMAs (as without AVX512_BF16) or not");
  m.def("set_amx", &set_amx, "packed_linear, prefill_attention (bfloat16) and qlinear on the AMX tiles (default) or not");
  m.def("argmax_rows", &argmax_rows, "torch.argmax(x, -1) of float32 rows, vectorised");
  m.def("huge_page_buffer", &huge_page_buffer, "uninitialised bytes on 2 MiB-aligned memory advised for huge pages");
  m.def("paged_decode_attention", &paged_decode_attention, "one-token attention over paged K/V read in place",
        no_gil);
  bind_decode_stack(m);
}
