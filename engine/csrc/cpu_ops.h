// The kernels each file of engine/csrc defines for the others: what the Python module binds (bindings.cpp) and
// what the decode stack (decode_stack.h) calls without going back through Python.
//
// ATen's tensor type only, not <torch/extension.h>: that header (pybind11 and all of libtorch's C++ API) costs the
// compiler ~26 s per file on a 2-core Zen 4 against ~2 s for this one, and only bindings.cpp needs it.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/Optional.h>

#include <cstdint>

// cpu_ops.cpp
at::Tensor linear(const at::Tensor& x, const at::Tensor& weight, const c10::optional<at::Tensor>& bias);
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps);
at::Tensor add_rms_norm_(at::Tensor& residual, const at::Tensor& delta, const at::Tensor& weight, double eps);
at::Tensor silu_mul(const at::Tensor& gate_up);
void rope_(at::Tensor& qkv, const at::Tensor& positions, const at::Tensor& cos, const at::Tensor& sin,
           int64_t num_heads, int64_t head_dim);
void write_kv_(at::Tensor& cache, const at::Tensor& k, const at::Tensor& v, const at::Tensor& slots);
at::Tensor paged_decode_attention(const at::Tensor& q, const at::Tensor& cache, const at::Tensor& block_table,
                                  const at::Tensor& context_lens, int64_t block_size, double scale);
at::Tensor huge_page_buffer(int64_t nbytes);

// quant_ops.cpp
at::Tensor qlinear(const at::Tensor& x, const at::Tensor& data, const at::Tensor& scale,
                   const c10::optional<at::Tensor>& offset, int64_t zero, int64_t bits, int64_t N,
                   const c10::optional<at::Tensor>& bias);
bool qlinear_int_dot();
bool qlinear_amx();

// argmax.cpp
at::Tensor argmax_rows(const at::Tensor& x);

// packed_linear.cpp
bool packed_linear_supported(const at::Tensor& weight);
at::Tensor pack_linear_weight(const at::Tensor& weight);
at::Tensor packed_linear(const at::Tensor& x, const at::Tensor& packed, int64_t N,
                         const c10::optional<at::Tensor>& bias, const c10::optional<at::Tensor>& next,
                         int64_t next_N, bool float_out);
at::Tensor packed_linear_silu(const at::Tensor& x, const at::Tensor& packed, int64_t I,
                              const c10::optional<at::Tensor>& next, int64_t next_N);
int64_t packed_silu_half_panel();
bool set_amx(bool enabled);
bool set_widened_bf16(bool enabled);

// prefill_attention.cpp
bool prefill_attention_supported(const at::Tensor& q);
at::Tensor prefill_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, double scale);
