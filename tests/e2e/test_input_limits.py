"""The public port's limits on an in-process gateway in front of a real aggregated worker (tests.e2e.inprocess):
the gRPC size limit is RESOURCE_EXHAUSTED, gRPC's own; the prompt token limit a clear INVALID_ARGUMENT. The
other limits, and the chat template sandbox: tests/unit/test_input_limits.py."""

from __future__ import annotations

import grpc
import pytest

from protos import common_pb2 as cpb
from protos import gateway_pb2_grpc as gpb_grpc
from tests.e2e.inprocess import Stack
from tests.unit.test_input_limits import request


def test_the_public_port_takes_smaller_messages(default_model, aggregated_worker):
    stack = Stack(default_model, aggregated_worker, ["--max-request-bytes", "4096", "--max-prompt-tokens", "8"])
    try:
        with grpc.insecure_channel(stack.gateway) as ch:
            stub = gpb_grpc.GatewayStub(ch)
            with pytest.raises(grpc.RpcError) as err:
                list(stub.Generate(request(prompt="x" * 5000), timeout=10))
            assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "larger than max" in err.value.details()
            with pytest.raises(grpc.RpcError) as err:
                list(stub.Generate(request(prompt="word " * 100), timeout=10))
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert "this gateway takes at most 8 prompt tokens" in err.value.details()
            short = request(prompt="Hello", sampling=cpb.SamplingParams(max_tokens=2))
            assert list(stub.Generate(short, timeout=10))[-1].finish_reason
    finally:
        stack.close()
