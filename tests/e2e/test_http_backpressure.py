"""A reader that falls behind its HTTP stream is cut off and holds up nobody: the gateway in process (so the test
can stop reading one request's merged stream at will), in front of a real aggregated worker."""

from __future__ import annotations

from gateway.openai_api.convert import completion_plan
from gateway.openai_api.fanout import Fanout, SlowReader
from gateway.openai_api.protocol import CompletionRequest
from tests.e2e.inprocess import Stack
from tests.e2e.pipeline import call, token_request, wait_until, worker_stats

BUFFER = 4


def test_a_client_that_stops_reading_is_cancelled_and_holds_up_nobody(default_model, aggregated_worker):
    stack = Stack(default_model, aggregated_worker)
    try:
        async def scenario():
            plan = completion_plan(CompletionRequest(prompt=[1, 2, 3, 4], max_tokens=200, ignore_eos=True,
                                                     temperature=0))
            slow = Fanout(stack.gateway_core, plan.choices, [], BUFFER)
            slow.start()  # and never read: its messages pile up to BUFFER, then it is cut
            other = await call(stack.gateway, token_request([5, 6, 7, 8], 40))
            first = await slow.next(timeout=60)
            await slow.close()
            return other, first

        other, first = stack.loop.run(scenario(), timeout=120)
        assert other.code.name == "OK" and len(other.tokens) == 40  # served meanwhile, in full
        assert isinstance(first.error, SlowReader)  # the error comes before the backlog
        assert "fell 4 messages behind" in str(first.error)
        core = stack.gateway_core
        assert wait_until(lambda: worker_stats(aggregated_worker).num_requests == 0, 10)
        assert core.inflight == 0 and core.finished_by_code["CANCELLED"] == 1
    finally:
        stack.close()
