"""Quantized weights: the integer kernel against a dequantize-then-matmul reference, GGUF files read exactly,
and quantized tiny models against the float model of the same (dequantized) weights.

The kernel quantizes activations per 32-block to int8 (as llama.cpp does); ``qlinear_reference`` quantizes them
the same way and sums in float64, so kernel and reference differ only in float32 summation order.
"""

from __future__ import annotations

import logging

import numpy as np
import pytest
import torch

from engine import Engine, EngineConfig, SamplingParams, cpu_ops
from engine.kernels import CpuKernels, TorchKernels
from engine.quant import QuantizedWeight, dequantize, fp8_linear, fp8_supported, quantize_fp8, quantize_int8
from engine.quant.gguf_file import _BLOCK_FORMATS, GGUFWeights
from engine.quant.gguf_reader import GGUFFile
from engine.quant.reference import qlinear_dequantized, qlinear_reference
from tests.gguf_files import dequantized_copy, write_gguf
from tests.unit.test_engine_correctness import mixed_prompts, run_engine


@pytest.fixture(scope="module")
def ops():
    module = cpu_ops.load()
    assert module is not None, "the CPU kernels must build on the CI machine"
    return module


def gguf_weight(w: torch.Tensor, kind: str) -> QuantizedWeight:
    """``w`` quantized by llama.cpp's reference quantizer (the gguf package), read back by tandem."""
    from gguf import GGMLQuantizationType, quants

    raw = quants.quantize(w.float().numpy(), getattr(GGMLQuantizationType, kind))
    return QuantizedWeight.from_values(*_BLOCK_FORMATS[kind](raw), kind.lower())


def make_weight(kind: str, n: int, k: int, seed: int) -> QuantizedWeight:
    w = torch.randn(n, k, generator=torch.Generator().manual_seed(seed)) / k**0.5
    return quantize_int8(w) if kind == "int8" else gguf_weight(w, kind)


@pytest.mark.parametrize("kind", ["Q4_0", "Q4_1", "Q8_0"])
@pytest.mark.parametrize("k", [32, 96, 576, 1536])
def test_gguf_blocks_dequantize_exactly(kind, k):
    """tandem's scale * u + offset equals the gguf package's dequantization bit for bit."""
    from gguf import GGMLQuantizationType, quants

    w = torch.randn(9, k, generator=torch.Generator().manual_seed(k))
    qtype = getattr(GGMLQuantizationType, kind)
    raw = quants.quantize(w.numpy(), qtype)
    want = torch.from_numpy(quants.dequantize(raw, qtype).astype(np.float32))
    assert torch.equal(dequantize(gguf_weight(w, kind)), want)


@pytest.mark.parametrize("kind", ["Q4_0", "Q4_1", "Q8_0", "int8"])
@pytest.mark.parametrize("rows", [1, 2, 3, 5, 17, 64])
@pytest.mark.parametrize("k, n, bias", [(576, 960, False), (32, 7, True), (96, 13, False), (1536, 64, True),
                                         (64, 48, False)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_qlinear_matches_reference(ops, kind, rows, k, n, bias, dtype):
    """Groups of 16 rows two at a time and an odd last one (n = 48), rows padded to 16, tiles of up to 4 rows of x.
    The integer kernel at every row count: AMX CPUs switched off the tiles (tested on their own below)."""
    w = make_weight(kind, n, k, seed=rows * k + n)
    g = torch.Generator().manual_seed(rows + k)
    x = torch.randn(rows, k, generator=g).to(dtype)
    b = torch.randn(n, generator=g) if bias else None
    ops.set_amx(False)
    try:
        got = ops.qlinear(x, w.data, w.scale, w.offset, w.zero, w.bits, w.rows, b)
    finally:
        ops.set_amx(True)
    want = qlinear_reference(x, w, b)
    assert got.dtype == dtype and got.shape == (rows, n)
    if dtype == torch.float32:
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    else:  # one rounding of the output to bfloat16 (the reference is rounded once too)
        torch.testing.assert_close(got.float(), want.float(), rtol=1e-2, atol=1e-2)


@pytest.mark.parametrize("fill", [255, 0])
def test_qlinear_is_exact_at_the_ends_of_the_8_bit_range(ops, fill):
    """Weight bytes of 255 (or 0) against activations at +-127 in every position: products whose pair sums
    overflow 16 bits (255 x 127 x 2), which a vpmaddubsw kernel would saturate (AVX2 CPUs multiply in int16)."""
    w = make_weight("Q8_0", 32, 64, seed=1)
    w.data.fill_(fill)
    x = torch.full((2, 64), 3.0)
    x[1] = -3.0
    got = ops.qlinear(x, w.data, w.scale, w.offset, w.zero, w.bits, w.rows, None)
    torch.testing.assert_close(got, qlinear_reference(x, w), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_qlinear_rounds_x_to_nearest_even_at_ties(ops, dtype):
    """Blocks of x whose largest value is 127, so that each value is its own int8 times 1: halves round to even
    (0.5 -> 0, 2.5 -> 2, -1.5 -> -2), as the reference's torch.round does; rounding half away from zero, or
    truncating, moves these outputs far outside the tolerance. Rows in every position of a 4-row tile."""
    w = make_weight("Q8_0", 48, 64, seed=3)
    ties = torch.tensor([0.5, 1.5, 2.5, -0.5, -1.5, -2.5, 3.5, -3.5, 126.5, -126.5, 0.0, -0.0, 1.0, 7.25, 12.5, -12.5])
    x = torch.cat([torch.tensor([127.0]), ties.repeat(4)[:31], torch.tensor([-127.0]), ties.flip(0).repeat(2)[:31]])
    x = torch.stack([x, -x, x.roll(1), -x.roll(2), x]).to(dtype)
    got = ops.qlinear(x, w.data, w.scale, w.offset, w.zero, w.bits, w.rows, None)
    want = qlinear_reference(x, w)
    torch.testing.assert_close(got.float(), want.float(), rtol=1e-5 if dtype == torch.float32 else 1e-2, atol=1e-5)


@pytest.mark.parametrize("kind", ["Q4_0", "Q4_1", "Q8_0", "int8"])
@pytest.mark.parametrize("rows", [24, 33, 64])
@pytest.mark.parametrize("k, n, bias", [(576, 960, False), (32, 7, True), (1536, 64, True), (64, 48, False)])
def test_qlinear_on_amx_tiles_is_the_dequantized_matmul(ops, kind, rows, k, n, bias):
    """On AMX CPUs, 24 rows and more of bfloat16 x run on the bfloat16 tiles against the weight dequantized in the
    kernel (x is not quantized): the exact product of x and dequantize(w) rounded once to bfloat16, up to float32
    summation order; groups two at a time and an odd last one (n = 48), 17-32 rows in a second pair of tiles."""
    if not ops.QUANT_AMX:
        pytest.skip("no AMX on this CPU: qlinear runs the integer kernel at every row count")
    w = make_weight(kind, n, k, seed=rows * k + n)
    g = torch.Generator().manual_seed(rows + k)
    x = torch.randn(rows, k, generator=g).bfloat16()
    b = torch.randn(n, generator=g) if bias else None
    got = ops.qlinear(x, w.data, w.scale, w.offset, w.zero, w.bits, w.rows, b)
    exact = x.double() @ dequantize(w, torch.bfloat16).double().T + (b.double() if bias else 0)
    assert got.dtype == torch.bfloat16 and got.shape == (rows, n)
    torch.testing.assert_close(got.float(), exact.float(), rtol=2**-7, atol=1e-3)
    # a row's result is the same in any batch that takes the tiles
    part = ops.qlinear(x[:24].contiguous(), w.data, w.scale, w.offset, w.zero, w.bits, w.rows, b)
    assert torch.equal(part, got[:24])


def test_set_amx_switches_qlinear_to_the_integer_kernel(ops):
    """Switched off, many rows run the integer kernel, whose rows do not depend on their batch."""
    w = make_weight("Q4_1", 96, 576, seed=5)
    x = torch.randn(40, 576).bfloat16()
    assert ops.set_amx(False) is False
    try:
        many = ops.qlinear(x, w.data, w.scale, w.offset, w.zero, w.bits, w.rows, None)
    finally:
        ops.set_amx(True)
    ones = torch.cat([ops.qlinear(x[i:i + 1], w.data, w.scale, w.offset, w.zero, w.bits, w.rows, None)
                      for i in range(40)])
    assert torch.equal(many, ones)
    torch.testing.assert_close(many.float(), qlinear_reference(x, w).float(), rtol=1e-2, atol=1e-2)


def test_int8_activations_error_is_small(ops):
    """Against the float matmul of the dequantized weight (no activation rounding): within ~1% of the output's
    scale, the size of int8 rounding of x per 32-block."""
    w = make_weight("Q4_1", 576, 1536, seed=1)
    x = torch.randn(8, 1536)
    got = ops.qlinear(x, w.data, w.scale, w.offset, w.zero, w.bits, w.rows, None)
    exact = x @ dequantize(w).T
    assert ((got - exact).abs().max() / exact.abs().max()).item() < 1e-2


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("k", [32, 64, 512, 544, 1536])
def test_pack_unpack_round_trip(bits, k):
    u = torch.randint(0, 2**bits, (6, k), dtype=torch.uint8, generator=torch.Generator().manual_seed(k))
    w = QuantizedWeight.from_values(u, torch.ones(6, k // 32, dtype=torch.float16), None, 8, bits, "test")
    assert w.data.shape == (1, k // 32, 16 * 32 * bits // 8)  # one group of 16 rows (10 of padding), no padding in K
    assert torch.equal(w.values(), u)


def test_int8_quantizer_per_channel():
    w = torch.randn(16, 64) * torch.logspace(-3, 1, 16)[:, None]
    w[3] = 0  # an all-zero row: scale 0, no NaN
    q = quantize_int8(w)
    assert q.scales().shape == (16, 1) and q.kind == "int8" and q.zero == 128 and q.offset is None
    err = (dequantize(q) - w).abs()
    assert torch.all(err <= q.scales() / 2 + 1e-7)
    assert torch.equal(dequantize(q)[3], torch.zeros(64))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kernel_paths_agree(ops, dtype):
    """Many rows go to dequantize-then-GEMM, few to the integer kernel, and the portable kernels dequantize: all
    compute the same product (up to int8 activations). x is seeded like the weight: the integer kernel's error
    is a draw, and unseeded inputs put 4 of 300 float32 draws just past the tolerance (the worst at 1.007x)."""
    w = make_weight("Q4_1", 192, 576, seed=3)
    cpu, eager = CpuKernels(ops), TorchKernels()
    cpu.quant_gemm_rows[dtype] = 32
    x = torch.randn(33, 576, generator=torch.Generator().manual_seed(0)).to(dtype)
    torch.testing.assert_close(cpu.linear(x, w), qlinear_dequantized(x, w))
    torch.testing.assert_close(eager.linear(x, w), qlinear_dequantized(x, w))
    few = x[:4]
    tol = 2e-2 if dtype == torch.float32 else 6e-2
    torch.testing.assert_close(cpu.linear(few, w).float(), qlinear_dequantized(few, w).float(), rtol=tol, atol=tol)


def test_bad_inputs_are_refused(ops):
    w = make_weight("Q8_0", 8, 64, seed=0)
    with pytest.raises(RuntimeError, match="multiple of 32"):
        ops.qlinear(torch.randn(1, 65), w.data, w.scale, w.offset, w.zero, w.bits, w.rows, None)
    with pytest.raises(RuntimeError, match="float32 or bfloat16"):
        ops.qlinear(torch.randn(1, 64, dtype=torch.float64), w.data, w.scale, w.offset, w.zero, w.bits, w.rows, None)
    with pytest.raises(RuntimeError, match="one value per output"):
        ops.qlinear(torch.randn(1, 64), w.data, w.scale, w.offset, w.zero, w.bits, w.rows, torch.ones(3))
    with pytest.raises(ValueError, match="multiple of 32"):
        QuantizedWeight.from_values(torch.zeros(4, 48, dtype=torch.uint8), torch.ones(4, 1), None, 128, 8, "x")
    with pytest.raises(ValueError, match="float16 per block"):
        QuantizedWeight.from_values(torch.zeros(4, 64, dtype=torch.uint8), torch.ones(4, 2), None, 128, 8, "x")
    with pytest.raises(RuntimeError, match="scale float16"):
        ops.qlinear(torch.randn(1, 64), w.data, w.scale.float(), None, 128, 8, w.rows, None)
    with pytest.raises(RuntimeError, match="last group"):
        ops.qlinear(torch.randn(1, 64), w.data, w.scale, None, 128, 8, 40, None)


def first_differences(reference: Engine, prompts: list[list[int]], want: list[list[int]],
                      got: list[list[int]]) -> list[tuple[int, int, float]]:
    """For each output that differs: (prompt index, first differing step, the reference model's logprob gap between
    its own token and the quantized model's there). A small gap is a near-tie that int8 activations tipped."""
    found = []
    for i, (prompt, a, b) in enumerate(zip(prompts, want, got, strict=True)):
        step = next((j for j, (x, y) in enumerate(zip(a, b, strict=True)) if x != y), None)
        if step is None:
            continue
        rid = reference.add_request(prompt + a[:step], SamplingParams(max_tokens=1, temperature=0, logprobs=20))
        top = []
        while reference.has_unfinished():
            top += [dict(lp.top) for out in reference.step() if out.request_id == rid for lp in out.new_logprobs]
        gap = top[0][a[step]] - top[0].get(b[step], -float("inf"))
        found.append((i, step, gap))
    return found


def assert_greedy_equal_or_near_tie(reference: Engine, prompts: list[list[int]], want: list[list[int]],
                                    got: list[list[int]], max_gap: float, record) -> None:
    """Equal token for token, except where the first difference is a near-tie of the reference (reported)."""
    diffs = first_differences(reference, prompts, want, got)
    record("first_differences", diffs)
    assert all(gap < max_gap for _, _, gap in diffs), f"(prompt, step, logprob gap): {diffs}"


# -- GGUF files -----------------------------------------------------------------------------------------------

MIXED = {"v_proj": "Q8_0", "down_proj": "Q4_0", "lm_head": "Q8_0"}  # q|k|v fuses 4-bit with 8-bit rows


@pytest.fixture(scope="module")
def gguf_models(tiny_llama, tmp_path_factory):
    """(GGUF folder, the same weights dequantized into a float folder) for uniform Q4_1 and for mixed formats."""
    models = {}
    for name, qtypes in (("q4_1", {}), ("mixed", MIXED)):
        root = tmp_path_factory.mktemp(f"gguf-{name}")
        gguf_dir = write_gguf(tiny_llama, root / "gguf", qtypes).parent
        models[name] = (gguf_dir, dequantized_copy(gguf_dir, root / "float", 4, 2))
    return models


def test_gguf_reader_reads_what_gguf_wrote(gguf_models):
    from gguf import GGUFReader
    from gguf.quants import dequantize as gguf_dequantize

    path = gguf_models["mixed"][0] / "model.gguf"
    ours = GGUFFile(path)
    assert ours.fields["general.architecture"] == "llama" and ours.fields["llama.block_count"] == 2
    theirs = GGUFReader(str(path))
    assert {t.name for t in theirs.tensors} == set(ours.tensors)
    weights = GGUFWeights(path, 4, 2)
    for t in theirs.tensors:
        assert ours.tensors[t.name].shape == tuple(reversed([int(s) for s in t.shape]))
        assert np.asarray(ours.tensors[t.name].data).tobytes() == np.asarray(t.data).tobytes()
    q = weights.get("model.layers.0.mlp.down_proj.weight", torch.float32)
    down = next(t for t in theirs.tensors if t.name == "blk.0.ffn_down.weight")
    want = gguf_dequantize(down.data, down.tensor_type).astype(np.float32)
    assert q.kind == "q4_0" and torch.equal(dequantize(q), torch.from_numpy(want))
    assert weights.formats == {"Q4_0": 1}


# The float model's logprob gap (nats) between its token and the quantized model's at a first difference: int8
# activations tip near-ties (seen: up to 0.24 on these random models, whose top logits lie close); a wrong kernel
# gives gaps of several nats from the first token on.
MAX_GAP = 0.5


@pytest.mark.parametrize("name", ["q4_1", "mixed"])
def test_gguf_model_greedy_equals_float_model_of_same_weights(gguf_models, name, record_property):
    gguf_dir, float_dir = gguf_models[name]
    prompts = mixed_prompts(12, 256, 3, 40, seed=1)
    reference = Engine.from_model(str(float_dir), num_kv_blocks=64)
    want = run_engine(reference, prompts, [12] * 12)
    engine = Engine.from_model(str(gguf_dir), num_kv_blocks=64)
    assert engine.config.quantization == "gguf"  # a folder with a GGUF and no safetensors
    assert isinstance(engine.runner.model.layers[0].qkv, QuantizedWeight)
    assert_greedy_equal_or_near_tie(reference, prompts, want, run_engine(engine, prompts, [12] * 12), MAX_GAP,
                                    record_property)
    by_file = Engine.from_model(str(gguf_dir / "model.gguf"), num_kv_blocks=64, dtype="bfloat16")
    assert by_file.config.model == str(gguf_dir) and by_file.config.gguf_file == str(gguf_dir / "model.gguf")
    reference = Engine.from_model(str(float_dir), num_kv_blocks=64, dtype="bfloat16")
    bf16 = run_engine(reference, prompts, [12] * 12)
    assert_greedy_equal_or_near_tie(reference, prompts, bf16, run_engine(by_file, prompts, [12] * 12), MAX_GAP,
                                    record_property)


def test_int8_model_greedy_equals_float_model(tiny_models, record_property):
    prompts = mixed_prompts(12, 256, 3, 40, seed=2)
    for model in (tiny_models["llama"], tiny_models["llama-mha-tied"], tiny_models["qwen2"]):
        reference = Engine.from_model(str(model), num_kv_blocks=64)
        want = run_engine(reference, prompts, [12] * 12)
        engine = Engine.from_model(str(model), num_kv_blocks=64, quantization="int8")
        assert isinstance(engine.runner.model.lm_head, QuantizedWeight)  # tied ones too
        got = run_engine(engine, prompts, [12] * 12)
        assert_greedy_equal_or_near_tie(reference, prompts, want, got, MAX_GAP, record_property)


def test_other_gguf_formats_are_dequantized_with_a_warning(tiny_llama, tmp_path, caplog):
    gguf_dir = write_gguf(tiny_llama, tmp_path / "gguf", {"gate_proj": "Q5_0"}).parent
    float_dir = dequantized_copy(gguf_dir, tmp_path / "float", 4, 2)
    with caplog.at_level(logging.WARNING):
        engine = Engine.from_model(str(gguf_dir), num_kv_blocks=64)
    assert "Q5_0: dequantized" in caplog.text
    prompts = mixed_prompts(6, 256, 3, 20, seed=3)
    reference = Engine.from_model(str(float_dir), num_kv_blocks=64)
    assert_greedy_equal_or_near_tie(reference, prompts, run_engine(reference, prompts, [8] * 6),
                                    run_engine(engine, prompts, [8] * 6), MAX_GAP, lambda *_: None)


def test_quantization_setting_resolves(gguf_models, tiny_llama, tmp_path):
    gguf_dir, float_dir = gguf_models["q4_1"]
    assert EngineConfig(model=str(float_dir)).quantization == "none"
    assert EngineConfig(model=str(float_dir), quantization="int8").quantization == "int8"
    both = tmp_path / "both"
    both.mkdir()
    for f in [*float_dir.iterdir(), gguf_dir / "model.gguf"]:
        (both / f.name).symlink_to(f)
    assert EngineConfig(model=str(both)).quantization == "none"  # floats win unless gguf is asked for
    cfg = EngineConfig(model=str(both), quantization="gguf")
    assert cfg.gguf_file == str(both / "model.gguf")
    with pytest.raises(ValueError, match="exactly one .gguf file"):
        EngineConfig(model=str(tiny_llama), quantization="gguf")
    with pytest.raises(ValueError, match="quantization 'gguf' only"):
        EngineConfig(model=str(gguf_dir / "model.gguf"), quantization="int8")
    with pytest.raises(ValueError, match="quantization must be one of"):
        EngineConfig(model=str(float_dir), quantization="fp4")
    junk = tmp_path / "junk"
    junk.mkdir()
    (junk / "config.json").write_text((float_dir / "config.json").read_text())
    (junk / "model.gguf").write_bytes(b"not a gguf file at all")
    with pytest.raises(ValueError, match="not a GGUF file"):
        Engine.from_model(str(junk / "model.gguf"), num_kv_blocks=8)


def test_gguf_that_disagrees_with_config_is_refused(gguf_models, tmp_path):
    import json

    gguf_dir, _ = gguf_models["q4_1"]
    other = tmp_path / "other"
    other.mkdir()
    cfg = json.loads((gguf_dir / "config.json").read_text())
    cfg["num_hidden_layers"] = 1  # the file has 2
    (other / "config.json").write_text(json.dumps(cfg))
    (other / "model.gguf").symlink_to(gguf_dir / "model.gguf")
    with pytest.raises(ValueError, match="block_count is 2, config.json says 1"):
        Engine.from_model(str(other), num_kv_blocks=8)


def test_quantized_weights_never_share_kv_blocks(gguf_models):
    """The fingerprint in every block key tells the three apart: their KV differs."""
    gguf_dir, float_dir = gguf_models["q4_1"]
    prints = {Engine.from_model(str(float_dir), num_kv_blocks=8).fingerprint,
              Engine.from_model(str(float_dir), num_kv_blocks=8, quantization="int8").fingerprint,
              Engine.from_model(str(gguf_dir), num_kv_blocks=8).fingerprint}
    assert len(prints) == 3


# -- FP8 (CUDA) -----------------------------------------------------------------------------------------------

def test_fp8_weights_and_scaled_mm_path():
    """The FP8 path's arithmetic, run through torch._scaled_mm's CPU implementation: per-channel e4m3 weights
    within e4m3's rounding, the product within its rounding of x and w."""
    from engine.quant.fp8 import dequantize_fp8

    w = torch.randn(64, 96) * torch.logspace(-2, 1, 64)[:, None]
    q = quantize_fp8(w)
    assert q.shape == (64, 96) and q.q_t.dtype == torch.float8_e4m3fn and q.scale.shape == (64,)
    assert ((dequantize_fp8(q) - w).abs() <= w.abs().amax(1, keepdim=True) / 16).all()  # 3 mantissa bits
    x = torch.randn(5, 96)
    b = torch.randn(64)
    want = x @ dequantize_fp8(q).T + b
    got = fp8_linear(x, q, b)
    assert ((got - want).abs().max() / want.abs().max()).item() < 0.1
    odd = quantize_fp8(torch.randn(10, 40))  # not multiples of 16: the dequantized fallback
    torch.testing.assert_close(fp8_linear(x[:, :40], odd), x[:, :40] @ dequantize_fp8(odd).T)
    torch.testing.assert_close(TorchKernels().linear(x, q, b), got)


def test_fp8_is_refused_where_there_are_no_fp8_tensor_cores(tiny_llama):
    with pytest.raises(ValueError, match="fp8.*CUDA GPUs only"):
        EngineConfig(model=str(tiny_llama), quantization="fp8")


def _cuda_fp8() -> bool:
    return torch.cuda.is_available() and fp8_supported(torch.device("cuda"))[0]


@pytest.mark.skipif(not _cuda_fp8(), reason="needs a CUDA GPU with FP8 tensor cores (runs wherever there is one)")
def test_fp8_model_on_cuda_close_to_bfloat16(tiny_llama):
    prompts = mixed_prompts(6, 256, 3, 40, seed=4)
    reference = Engine.from_model(str(tiny_llama), num_kv_blocks=64, device="cuda", dtype="bfloat16")
    engine = Engine.from_model(str(tiny_llama), num_kv_blocks=64, device="cuda", dtype="bfloat16", quantization="fp8")
    want, got = run_engine(reference, prompts, [8] * 6), run_engine(engine, prompts, [8] * 6)
    assert_greedy_equal_or_near_tie(reference, prompts, want, got, 1.0, lambda *_: None)


def test_dummy_weights_drawn_on_another_device_have_their_own_weights_id():
    from engine.loader import weights_id

    cpu = weights_id("m", "dummy", 3)
    assert cpu == weights_id("m", "dummy", 3, device="cpu") == "dummy:3"  # unchanged on CPU
    assert weights_id("m", "dummy", 3, device="cuda:0") == "dummy:3:cuda" != cpu
