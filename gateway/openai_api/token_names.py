"""Token ids to the strings and bytes that OpenAI's log probabilities name tokens by.

The gateway loads no tokenizer (tokenizer_svc owns it): ids it has not seen yet are asked for in one
``TokenStrings`` call per response, and remembered. A vocabulary is at most a few hundred thousand
entries and only the ids that occur are kept, so the cache is bounded by ``MAX_ENTRIES`` and simply
cleared when full.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import grpc

from gateway.generation import GenerationError
from protos import tokenizer_pb2 as tpb
from protos import tokenizer_pb2_grpc as tpb_grpc

MAX_ENTRIES = 262_144
TIMEOUT_S = 5.0
MAX_IDS_PER_CALL = 4096  # tokenizer_svc's limit per TokenStrings call


class TokenNames:
    def __init__(self, stub: tpb_grpc.TokenizerStub) -> None:
        self._stub = stub
        self._known: dict[int, tuple[str, bytes]] = {}

    async def learn(self, ids: Iterable[int], metadata: Sequence[tuple[str, str]] = ()) -> None:
        """Make ``text`` and ``raw`` answer for every id in ``ids``."""
        missing = sorted({i for i in ids if i not in self._known})
        if not missing:
            return
        if len(self._known) + len(missing) > MAX_ENTRIES:
            self._known.clear()
        for start in range(0, len(missing), MAX_IDS_PER_CALL):
            ids = missing[start:start + MAX_IDS_PER_CALL]
            try:
                res = await self._stub.TokenStrings(tpb.TokenStringsRequest(token_ids=ids), timeout=TIMEOUT_S,
                                                    metadata=metadata)
            except grpc.aio.AioRpcError as exc:
                raise GenerationError(grpc.StatusCode.UNAVAILABLE, f"tokenizer: {exc.details()}") from exc
            self._known.update(zip(ids, zip(res.texts, res.raw, strict=True), strict=True))

    def text(self, token_id: int) -> str:
        return self._known[token_id][0]

    def raw(self, token_id: int) -> bytes:
        return self._known[token_id][1]
