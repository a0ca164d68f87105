// The kernels each file of engine/csrc defines for the others: what the Python module binds (cpu_ops.cpp) and
// what the decode stack (decode_stack.cpp) calls without going back through Python.
#pragma once

#include <torch/extension.h>

#include <cstdint>

// cpu_ops.cpp
torch::Tensor linear(const torch::Tensor& x, const torch::Tensor& weight, const c10::optional<torch::Tensor>& bias);
torch::Tensor rms_norm(const torch::Tensor& x, const torch::Tensor& weight, double eps);
torch::Tensor add_rms_norm_(torch::Tensor& residual, const torch::Tensor& delta, const torch::Tensor& weight,
                            double eps);
torch::Tensor silu_mul(const torch::Tensor& gate_up);
void rope_(torch::Tensor& qkv, const torch::Tensor& positions, const torch::Tensor& cos, const torch::Tensor& sin,
           int64_t num_heads, int64_t head_dim);
void write_kv_(torch::Tensor& cache, const torch::Tensor& k, const torch::Tensor& v, const torch::Tensor& slots);
torch::Tensor paged_decode_attention(const torch::Tensor& q, const torch::Tensor& cache, const torch::Tensor& block_table,
                                     const torch::Tensor& context_lens, int64_t block_size, double scale);
torch::Tensor huge_page_buffer(int64_t nbytes);

// quant_ops.cpp
torch::Tensor qlinear(const torch::Tensor& x, const torch::Tensor& data, const torch::Tensor& scale,
                      const c10::optional<torch::Tensor>& offset, int64_t zero, int64_t bits, int64_t N,
                      const c10::optional<torch::Tensor>& bias);
bool qlinear_int_dot();
bool qlinear_amx();

// argmax.cpp
torch::Tensor argmax_rows(const torch::Tensor& x);

// packed_linear.cpp
bool packed_linear_supported(const torch::Tensor& weight);
torch::Tensor pack_linear_weight(const torch::Tensor& weight);
torch::Tensor packed_linear(const torch::Tensor& x, const torch::Tensor& packed, int64_t N,
                            const c10::optional<torch::Tensor>& bias, const c10::optional<torch::Tensor>& next,
                            int64_t next_N, bool float_out);
torch::Tensor packed_linear_silu(const torch::Tensor& x, const torch::Tensor& packed, int64_t I,
                                 const c10::optional<torch::Tensor>& next, int64_t next_N);
int64_t packed_silu_half_panel();
bool set_amx(bool enabled);
bool set_widened_bf16(bool enabled);

// prefill_attention.cpp
bool prefill_attention_supported(const torch::Tensor& q);
torch::Tensor prefill_attention(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v, double scale);

// decode_stack.cpp
void bind_decode_stack(pybind11::module& m);
