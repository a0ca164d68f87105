"""Decode worker: the engine in the consumer role, pulling KV from the kvstore (or prefilling itself, aggregated)."""
