"""The public API: validation, routing, prefill -> first token -> decode orchestration, streaming."""
