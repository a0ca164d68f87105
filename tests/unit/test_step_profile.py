"""``tandem bench offline --scenarios step-profile`` on a tiny model: the 1,024-token prefill is read against the
better of two GEMM readings, the one taken at the start and one taken just before it."""

from __future__ import annotations

import pytest

from engine import Engine
from tandem.bench.step_profile import format_profile, step_profile
from tandem.gpu_check import tiny_checkpoint


@pytest.fixture(scope="module")
def tiny_long(tmp_path_factory: pytest.TempPathFactory):
    return tiny_checkpoint(tmp_path_factory.mktemp("tiny-long"), "llama", max_position_embeddings=2048)


def test_prefill_is_read_against_the_better_gemm_reading(tiny_long):
    result = step_profile(lambda **o: Engine.from_model(str(tiny_long), **o), "float32", 256, seed=0, bw=20.0,
                          batches=(1,), steps=2)
    prefill = result["prefill"]
    assert prefill["prompt_tokens"] == 1024
    assert prefill["gemm_gflop_s"] >= result["gemm_gflop_s"] > 0
    assert prefill["fraction_of_gemm_rate"] == pytest.approx(prefill["gflop_s"] / prefill["gemm_gflop_s"])
    last = format_profile(result).splitlines()[-1]
    assert f"of the GEMM rate of {prefill['gemm_gflop_s']:.0f} (the better of two readings;" in last
