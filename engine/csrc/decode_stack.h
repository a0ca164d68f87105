// A decoder's layers for one decode step in one call: LlamaModel.forward (engine/model.py) for the step where
// every request decodes one token, written again in C++ over the same kernels, in the same order, with the same
// bits out.
//
// Why: driven from Python, a decode step of the default model makes ~360 kernel calls (12 per layer, 30 layers),
// and between two of them the main thread runs the interpreter, pybind's argument conversion and the kernels'
// Python wrappers while the other threads wait for the next parallel region. This is what CUDA graphs do for
// the GPU path: the step's launches without the host language in between. Steps alternated in one process on a
// 2-core Zen 4, bfloat16: 1 sequence 9.56 -> 9.19 ms, 16 sequences 15.67 -> 15.16, 64 sequences 55.1 -> 54.1;
// float32, 16 sequences 35.9 -> 33.7. It serves only what it was built for (every matrix packed, the paged CPU
// cache, no tensor parallelism); the model falls back to its Python forward for everything else, prefill
// included.
//
// It also releases the GIL for the step (bindings.cpp), so that the service's event loop runs while the engine
// computes.
#pragma once

#include <cstdint>
#include <utility>
#include <vector>

#include "cpu_ops.h"

namespace tandem_stack {

// A matrix packed for packed_linear (CpuKernels' PackedWeight): its panels, output count, the bias, and the
// matrix the forward pass reads after it (whose first panels the kernel fetches during its last).
struct StackLinear {
  at::Tensor data;
  int64_t rows;
  c10::optional<at::Tensor> bias;
  c10::optional<at::Tensor> next;
  int64_t next_rows;

  StackLinear(at::Tensor data, int64_t rows, c10::optional<at::Tensor> bias, c10::optional<at::Tensor> next,
              int64_t next_rows)
      : data(std::move(data)), rows(rows), bias(std::move(bias)), next(std::move(next)), next_rows(next_rows) {}

  at::Tensor operator()(const at::Tensor& x) const {
    return packed_linear(x, data, rows, bias, next, next_rows, false);
  }
};

// One decoder layer (engine.model.LayerWeights): gate_up packed in half-panels, `rows` its intermediate size.
struct StackLayer {
  at::Tensor input_norm, post_norm;
  StackLinear qkv, o_proj, gate_up, down;

  StackLayer(at::Tensor input_norm, StackLinear qkv, StackLinear o_proj, at::Tensor post_norm,
             StackLinear gate_up, StackLinear down)
      : input_norm(std::move(input_norm)), post_norm(std::move(post_norm)), qkv(std::move(qkv)),
        o_proj(std::move(o_proj)), gate_up(std::move(gate_up)), down(std::move(down)) {}
};

class DecodeStack {
 public:
  DecodeStack(std::vector<StackLayer> layers, at::Tensor final_norm, double eps, int64_t num_heads,
              int64_t num_kv_heads, int64_t head_dim)
      : layers_(std::move(layers)), final_norm_(std::move(final_norm)), eps_(eps), heads_(num_heads),
        kv_heads_(num_kv_heads), head_dim_(head_dim) {}

  // x [B, H]: the step's embedded tokens, the residual stream (updated in place); returns the hidden states
  // after the final norm. The rest as the Python forward and the paged attention backend take them.
  at::Tensor forward(at::Tensor x, const at::Tensor& positions, const at::Tensor& cos,
                     const at::Tensor& sin, std::vector<at::Tensor> caches, const at::Tensor& slots,
                     const at::Tensor& block_table, const at::Tensor& context_lens, int64_t block_size,
                     double scale) const {
    TORCH_CHECK(caches.size() == layers_.size(), "decode stack: one KV cache per layer");
    const int64_t n = x.size(0);
    at::Tensor delta;  // what the last sub-block adds to the residual stream
    for (size_t i = 0; i < layers_.size(); ++i) {
      const StackLayer& layer = layers_[i];
      at::Tensor h = norm(x, delta, layer.input_norm);
      at::Tensor qkv = layer.qkv(h);
      rope_(qkv, positions, cos, sin, heads_ + kv_heads_, head_dim_);
      auto q_k_v = qkv.view({n, heads_ + 2 * kv_heads_, head_dim_}).split_with_sizes({heads_, kv_heads_, kv_heads_}, 1);
      write_kv_(caches[i], q_k_v[1], q_k_v[2], slots);
      delta = layer.o_proj(paged_decode_attention(q_k_v[0], caches[i], block_table, context_lens, block_size, scale));
      h = norm(x, delta, layer.post_norm);
      const StackLinear& gu = layer.gate_up;
      delta = layer.down(packed_linear_silu(h, gu.data, gu.rows, gu.next, gu.next_rows));
    }
    return norm(x, delta, final_norm_);
  }

  size_t num_layers() const { return layers_.size(); }

 private:
  at::Tensor norm(at::Tensor& x, const at::Tensor& delta, const at::Tensor& weight) const {
    return delta.defined() ? add_rms_norm_(x, delta, weight, eps_) : rms_norm(x, weight, eps_);
  }

  std::vector<StackLayer> layers_;
  at::Tensor final_norm_;
  double eps_;
  int64_t heads_, kv_heads_, head_dim_;
};

}  // namespace tandem_stack
