"""Bad input is refused at add_request with a clear reason; the engine keeps serving."""

from __future__ import annotations

import json

import pytest

from engine import Engine, EngineConfig, SamplingParams, UnsupportedModelError


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"max_tokens": 0}, "max_tokens"),
        ({"temperature": -0.1}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"top_k": -2}, "top_k"),
        ({"min_p": 2.0}, "min_p"),
        ({"logprobs": 99}, "logprobs"),
        ({"temperature": float("nan")}, "temperature"),
        ({"temperature": float("inf")}, "temperature"),
        ({"repetition_penalty": float("nan")}, "repetition_penalty"),
        ({"repetition_penalty": float("inf")}, "repetition_penalty"),
        ({"top_p": float("nan")}, "top_p"),
        ({"min_p": float("nan")}, "min_p"),
        ({"presence_penalty": float("nan")}, "presence_penalty"),
        ({"frequency_penalty": float("inf")}, "frequency_penalty"),
    ],
)
def test_bad_sampling_params(kwargs, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**kwargs)


def test_bad_prompts_are_refused_and_others_still_served(tiny_llama):
    engine = Engine.from_model(str(tiny_llama), num_kv_blocks=8, max_model_len=256)
    good = engine.add_request([1, 2, 3], SamplingParams(max_tokens=5, temperature=0))
    with pytest.raises(ValueError, match="empty"):
        engine.add_request([], SamplingParams())
    with pytest.raises(ValueError, match="exceeds the model length"):
        engine.add_request([1] * 250, SamplingParams(max_tokens=7))
    with pytest.raises(ValueError, match=r"token ids must be integers in \[0, 256\)"):
        engine.add_request([1, 999], SamplingParams())
    with pytest.raises(ValueError, match="more KV blocks than the whole cache"):
        engine.add_request([1] * 200, SamplingParams(max_tokens=8))
    with pytest.raises(ValueError, match="already in use"):
        engine.add_request([1], SamplingParams(), request_id=good)
    done = []
    while engine.has_unfinished():
        done += [o for o in engine.step() if o.finished]
    assert [o.request_id for o in done] == [good] and done[0].num_output_tokens == 5
    assert engine.num_free_blocks == engine.num_total_blocks


def test_unknown_model_folder(tmp_path):
    with pytest.raises(FileNotFoundError, match="config.json"):
        EngineConfig(model=str(tmp_path / "nope"))


def test_unsupported_config(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt2", "num_attention_heads": 2}))
    with pytest.raises(UnsupportedModelError, match="gpt2"):
        EngineConfig(model=str(tmp_path))


def test_bad_engine_settings(tiny_llama):
    with pytest.raises(ValueError, match="float16 is supported on CUDA only"):
        EngineConfig(model=str(tiny_llama), dtype="float16")
    with pytest.raises(ValueError, match="max_model_len"):
        EngineConfig(model=str(tiny_llama), max_model_len=10**6)


def test_dummy_weights_from_config_alone(tiny_llama, tmp_path):
    (tmp_path / "config.json").write_text((tiny_llama / "config.json").read_text())
    engine = Engine.from_model(str(tmp_path), load_format="dummy", num_kv_blocks=8)
    out = engine.generate([[1, 2, 3]], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))
    assert len(out[0]) == 4
