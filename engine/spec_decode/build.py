"""The speculator an ``EngineConfig`` asks for (None without speculation)."""

from __future__ import annotations

from engine.config import EngineConfig
from engine.spec_decode.ngram import NgramProposer
from engine.spec_decode.speculator import Speculator


def build_speculator(config: EngineConfig, num_blocks: int) -> Speculator | None:
    """``num_blocks``: the target's KV blocks; a draft model gets as many, so that it mirrors every request."""
    method = config.speculative_method
    if method == "none" or config.role == "producer":  # a prefill worker samples one token per request
        return None
    if method == "ngram":
        proposer = NgramProposer(config.prompt_lookup_min, config.prompt_lookup_max)
    else:
        from engine.spec_decode.draft import DraftProposer

        proposer = DraftProposer(config, num_blocks)
    return Speculator(proposer, config.num_speculative_tokens, config.speculative_max_batch,
                      config.speculative_min_acceptance)
