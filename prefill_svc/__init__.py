"""Prefill worker: the engine in the producer role, pushing the prompt's KV to the kvstore."""
