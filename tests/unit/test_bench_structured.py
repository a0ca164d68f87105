"""``tandem bench structured`` on a tiny model with the default vocabulary: the step timing keeps its batch
full of constrained requests and times only decode steps; compile times cover every schema."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from engine import Engine
from tandem.bench.schemas import SCHEMAS
from tandem.bench.structured import compile_times, format_tables, step_overhead
from tests.conftest import _save_tiny


@pytest.fixture(scope="module")
def model(tmp_path_factory, default_model: Path) -> Path:
    path = _save_tiny(tmp_path_factory.mktemp("tiny-vocab"), "llama", vocab_size=49152, eos_token_id=2)
    shutil.copy(default_model / "tokenizer.json", path / "tokenizer.json")
    return path


def test_step_overhead_and_compile_times(model):
    engine = Engine.from_model(str(model), num_kv_blocks=512)
    prompts = [[1, 2, 3, 4, 5], [6, 7, 8]]
    rows = step_overhead(engine, prompts, [1, 3], steps=3, repeats=1)
    assert [r["batch"] for r in rows] == [1, 3] and all(r["timed_steps"] == [3, 3] for r in rows)
    assert all(r["mask_ms_per_step"] > 0 and r["mask_us_per_row"] > 0 for r in rows)
    assert not engine.has_unfinished(), "the bench aborts what it started"
    mc = engine.model_config
    tokenizer_s, compiles = compile_times(model / "tokenizer.json", mc.vocab_size, mc.eos_token_ids)
    assert tokenizer_s > 0 and [c["schema"] for c in compiles] == list(SCHEMAS)
    assert all(c["compile_cached_ms"] < c["compile_first_ms"] for c in compiles), "the second compile is a hit"
    assert "| 3 |" in format_tables(rows, tokenizer_s, compiles)
