"""One request's text, produced incrementally by tokenizer_svc over a Detokenize stream.

The stream stays open for the life of the request: each batch of new token ids
goes out and its text delta comes back, so the gateway never loads a tokenizer
and the text matches what transformers' ``decode`` gives for the whole sequence.
"""

from __future__ import annotations

import contextlib

import grpc

from protos import tokenizer_pb2 as tpb
from protos import tokenizer_pb2_grpc as tpb_grpc


class RemoteDetokenizer:
    def __init__(self, stub: tpb_grpc.TokenizerStub, keep_special_tokens: bool, timeout: float | None) -> None:
        self._call = stub.Detokenize(timeout=timeout)
        self._keep = keep_special_tokens
        self._first = True
        self._finished = False

    async def push(self, token_ids: list[int], finish: bool = False) -> str:
        """The text delta for ``token_ids``; ``finish`` also flushes what was held back."""
        req = tpb.DetokenizeRequest(token_ids=token_ids, finish=finish)
        if self._first:
            req.keep_special_tokens, self._first = self._keep, False
        await self._call.write(req)
        res = await self._call.read()
        if res is grpc.aio.EOF:
            raise ConnectionError("the tokenizer service closed the Detokenize stream")
        if finish:
            self._finished = True
        return res.text

    async def close(self) -> None:
        """End the stream: politely when it finished, by cancelling otherwise."""
        if self._finished:
            with contextlib.suppress(grpc.aio.AioRpcError, grpc.aio.UsageError):
                await self._call.done_writing()
                return
        self._call.cancel()
