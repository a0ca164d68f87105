"""The gateway's request plan: sampling parameters are converted to the workers' message once, in
validation, and a plan refuses to go out without them. Retries and migrations through real workers are
tests/e2e/test_pipeline.py's and tests/e2e/test_migration.py's."""

from __future__ import annotations

import pytest

from gateway.generation import Plan
from gateway.validation import ModelLimits, check_length, validate
from protos import common_pb2 as cpb
from protos import gateway_pb2 as gpb

BS = 4
FINGERPRINT = b"\x07" * 32
SALT = "tenant"
PROMPT = list(range(1, 11))  # two full blocks and a partial one
LIMITS = ModelLimits(model="m", vocab_size=1000, max_model_len=64, max_request_tokens=4096)


def test_a_plan_needs_resolved_sampling():
    valid = validate(gpb.GenerateRequest(token_ids=gpb.TokenIds(ids=PROMPT)), LIMITS)
    plan = Plan(valid, PROMPT, [], 0, "", 0, BS, FINGERPRINT)
    with pytest.raises(RuntimeError, match="check_length"):
        plan.sampling  # noqa: B018


def test_sampling_is_converted_once_with_every_field_set():
    valid = validate(gpb.GenerateRequest(token_ids=gpb.TokenIds(ids=PROMPT),
                                         sampling=cpb.SamplingParams(temperature=0.5, seed=3)), LIMITS)
    check_length(valid, len(PROMPT), LIMITS)
    plan = Plan(valid, PROMPT, [], 0, SALT, 0, BS, FINGERPRINT)
    assert plan.sampling is valid.sampling  # the one message every prefill, decode and migration sends
    assert valid.sampling.max_tokens == LIMITS.max_model_len - len(PROMPT)
    assert valid.sampling.HasField("top_p") and valid.sampling.seed == 3 and valid.sampling.temperature == 0.5
