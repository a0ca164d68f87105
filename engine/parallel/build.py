"""The engine's model runner for its tensor-parallel degree."""

from __future__ import annotations

from typing import TYPE_CHECKING

from engine.model_runner import ModelRunner

if TYPE_CHECKING:
    from engine.config import EngineConfig
    from engine.parallel.executor import TPExecutor


def build_runner(config: EngineConfig) -> ModelRunner | TPExecutor:
    if config.tensor_parallel_size == 1:
        return ModelRunner(config)
    from engine.parallel.executor import TPExecutor

    return TPExecutor(config)
