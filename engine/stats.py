"""Counters an engine keeps about itself, for metrics and benchmarks."""

from __future__ import annotations

from dataclasses import dataclass, field

from engine.kv_cache_manager import PrefixCacheStats


@dataclass(frozen=True, slots=True)
class EngineLoad:
    """How busy an engine is, taken on the engine thread between steps and published whole, so that another
    thread (a worker's event loop serving Stats, /metrics and admission) never walks the scheduler's queues
    while the engine changes them."""

    num_running: int = 0
    num_waiting: int = 0
    num_loading: int = 0  # waiting for KV from outside
    num_unfinished: int = 0  # every request the engine holds, in any state
    used_blocks: int = 0
    total_blocks: int = 0
    queued_prompt_tokens: int = 0  # prompt tokens still to compute: the load a gateway balances on


@dataclass(slots=True)
class EngineStats:
    num_steps: int = 0
    prompt_tokens_computed: int = 0  # prompt tokens run through the model (cache hits excluded)
    generation_tokens: int = 0
    num_preemptions: int = 0
    kv_blocks_saved: int = 0
    kv_blocks_loaded: int = 0
    kv_load_failures: int = 0  # loads that failed and were recomputed instead
    structured_tokens: int = 0  # tokens sampled under a structured-output constraint
    grammar_errors: int = 0  # requests ended because their grammar allowed no further token
    prefix_cache: PrefixCacheStats = field(default_factory=PrefixCacheStats)
    last_step_overhead_s: float = 0.0  # scheduling and bookkeeping of the last step, the model excluded
