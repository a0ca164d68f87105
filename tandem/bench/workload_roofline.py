"""The fastest the offline workload could run on this machine: its prefill at the measured GEMM rate and each of
its decode steps at max(bytes read / read bandwidth, FLOPs / GEMM rate).

A single-stream roofline says nothing about a batched workload, whose decode steps turn from bandwidth-bound to
compute-bound as the batch grows and whose prefill is all GEMM. This bound is what `tandem bench offline`'s
batched out tok/s is a fraction of, so that one machine's figure can be read against another's (a 2-core Zen 4
at 441 GFLOP/s and a 2-core Xeon with AMX at 2,700 allow very different numbers for the same code).

The model: every request is admitted at once (the workload has fewer requests than ``max_num_seqs``), prefill
makes the first token, and decode step s runs every request with more than s tokens still to make. Not counted:
norms, RoPE, sampling and the scheduler (small next to the matmuls and the weights' stream); and a step's reads
and arithmetic are allowed to overlap completely. So this is a bound, never an estimate.
"""

from __future__ import annotations

from dataclasses import dataclass

from engine import ModelConfig


@dataclass(frozen=True, slots=True)
class WorkloadRoofline:
    prefill_s: float
    decode_s: float
    decode_steps: int
    out_tok_s: float


def linear_params(mc: ModelConfig) -> tuple[int, int]:
    """(the layers' matrix parameters, lm_head's): what a token multiplies through."""
    h, d = mc.hidden_size, mc.head_dim
    per_layer = h * (mc.num_heads + 2 * mc.num_kv_heads) * d + mc.num_heads * d * h + 3 * h * mc.intermediate_size
    return mc.num_layers * per_layer, mc.vocab_size * h


def attention_flops(mc: ModelConfig, queries: int, keys: float) -> float:
    """Scores and the weighted sum of values, every query head, every layer (``keys``: per query, on average)."""
    return 4.0 * mc.num_layers * mc.num_heads * mc.head_dim * queries * keys


def workload_roofline(mc: ModelConfig, prompt_lens: list[int], output_lens: list[int], weight_bytes: int,
                      kv_bytes_per_token: int, read_gbps: float, gemm_gflops: float,
                      budget: int) -> WorkloadRoofline:
    """The bound for prompts of ``prompt_lens`` and outputs of ``output_lens`` tokens (``budget``: prefill tokens
    per step, each such step reading the weights once)."""
    layers, head = linear_params(mc)
    bw, gemm = read_gbps * 1e9, gemm_gflops * 1e9
    prompt_tokens = sum(prompt_lens)
    prefill_flops = (2.0 * layers * prompt_tokens + 2.0 * head * len(prompt_lens)
                     + sum(attention_flops(mc, p, (p + 1) / 2) for p in prompt_lens))
    prefill_steps = -(-prompt_tokens // budget)
    prefill_s = max(prefill_flops / gemm, prefill_steps * weight_bytes / bw)
    decode_s, steps = 0.0, max(output_lens) - 1
    for s in range(1, steps + 1):
        contexts = [p + s for p, o in zip(prompt_lens, output_lens, strict=True) if o - 1 >= s]
        nbytes = weight_bytes + kv_bytes_per_token * sum(contexts)
        flops = 2.0 * (layers + head) * len(contexts) + sum(attention_flops(mc, 1, c) for c in contexts)
        decode_s += max(nbytes / bw, flops / gemm)
    return WorkloadRoofline(prefill_s, decode_s, steps, sum(output_lens) / (prefill_s + decode_s))
