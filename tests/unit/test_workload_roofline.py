"""The offline workload's roofline against sums written out by hand for a toy model."""

import pytest

from engine import ModelConfig
from tandem.bench.workload_roofline import linear_params, workload_roofline

# hidden 8, 2 heads of 4 (1 K/V head), MLP 16, 2 layers, vocab 32
MC = ModelConfig(model_type="llama", vocab_size=32, hidden_size=8, intermediate_size=16, num_layers=2, num_heads=2,
                 num_kv_heads=1, head_dim=4, rms_norm_eps=1e-5, rope_theta=1e4, max_position_embeddings=128,
                 tie_word_embeddings=True, qkv_bias=False)
LAYERS = 2 * (8 * (2 + 2) * 4 + 2 * 4 * 8 + 3 * 8 * 16)  # qkv, o_proj, gate/up/down per layer
HEAD = 32 * 8
WEIGHTS, KV = 4_000, 2 * 2 * 1 * 4 * 2  # bytes; K and V of a token, both layers, bfloat16


def test_linear_params_count_every_matrix_once() -> None:
    assert linear_params(MC) == (LAYERS, HEAD)


def test_bandwidth_bound_decode_reads_the_weights_and_each_live_context_every_step() -> None:
    # GEMM far faster than memory: every step costs its bytes; request 2 stops after its 1 decode step
    r = workload_roofline(MC, [10, 20], [4, 2], WEIGHTS, KV, read_gbps=1e-9 * 1e3, gemm_gflops=1e9, budget=64)
    contexts = [[11, 21], [12], [13]]  # decode steps 1..3: prompt + step, while the request still has tokens to make
    want = sum(WEIGHTS + KV * sum(c) for c in contexts) / 1e3
    assert r.decode_steps == 3
    assert r.decode_s == pytest.approx(want)
    assert r.prefill_s == pytest.approx(WEIGHTS / 1e3)  # 30 prompt tokens: one step at a budget of 64


def test_compute_bound_prefill_and_decode_count_matmuls_and_attention() -> None:
    # memory far faster than the GEMM: every step costs its FLOPs at 1e3 FLOP/s
    r = workload_roofline(MC, [3], [3], WEIGHTS, KV, read_gbps=1e9, gemm_gflops=1e-9 * 1e3, budget=64)
    attn = 4 * 2 * 2 * 4  # per query and key: scores and values, every head of every layer
    prefill = 2 * LAYERS * 3 + 2 * HEAD + attn * 3 * 2  # causal: 3 queries over 1 + 2 + 3 = 3 x (3 + 1) / 2 keys
    decode = sum(2 * (LAYERS + HEAD) + attn * c for c in (4, 5))
    assert r.prefill_s == pytest.approx(prefill / 1e3)
    assert r.decode_s == pytest.approx(decode / 1e3)
    assert r.out_tok_s == pytest.approx(3 / ((prefill + decode) / 1e3))


def test_prefill_steps_at_the_budget_each_read_the_weights() -> None:
    r = workload_roofline(MC, [100, 100, 100], [1, 1, 1], WEIGHTS, KV, read_gbps=1e-9 * 1e3, gemm_gflops=1e9,
                          budget=128)
    assert r.prefill_s == pytest.approx(3 * WEIGHTS / 1e3)  # 300 tokens in steps of 128
    assert r.decode_s == 0 and r.decode_steps == 0
