"""Coverage-guided fuzzing (atheris, libFuzzer) of where input enters tandem.

    python tests/fuzz/fuzz_inputs.py request -runs=100000          # GenerateRequest bytes -> validation
    TANDEM_FUZZ_MODEL=<hf folder> python tests/fuzz/fuzz_inputs.py detokenizer -max_total_time=600

``request``: bytes parsed as a GenerateRequest (or, for half the inputs, a request built field by field from
the bytes, to get past the parser), then ``validate`` and ``check_length``: nothing but InvalidRequest may
escape. ``detokenizer``: token ids in chunks through the incremental detokenizer: the deltas concatenate
to the whole decode. Any other exception, or an input slower than ``-timeout``, is a crash that libFuzzer
saves under ``-artifact_prefix``. Flags after the target are libFuzzer's (tests/e2e/test_fuzz.py runs a
bounded number of runs).
"""

from __future__ import annotations

import os
import sys

import atheris

with atheris.instrument_imports():
    from google.protobuf.message import DecodeError

    from gateway.validation import InvalidRequest, ModelLimits, check_length, validate
    from protos import common_pb2 as cpb
    from protos import gateway_pb2 as gpb
    from tokenizer_svc.tokenizer import IncrementalDetokenizer, TextTokenizer

LIMITS = ModelLimits(model="fake", vocab_size=49152, max_model_len=2048, max_request_tokens=2048)
FLOATS = ("temperature", "top_p", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty")
ROLES = ["system", "user", "assistant", "tool", "developer", "usr", ""]


def _built(fdp: atheris.FuzzedDataProvider) -> gpb.GenerateRequest:
    def text(n: int = 64) -> str:
        return fdp.ConsumeUnicodeNoSurrogates(fdp.ConsumeIntInRange(0, n))

    req = gpb.GenerateRequest(request_id=text(140), model=text(8), cache_salt=text(), priority=fdp.ConsumeInt(4))
    kind = fdp.ConsumeIntInRange(0, 3)
    if kind == 0:
        req.prompt = text(256)
    elif kind == 1:
        req.chat.SetInParent()
        for _ in range(fdp.ConsumeIntInRange(0, 4)):
            req.chat.messages.add(role=fdp.PickValueInList(ROLES), content=text())
    elif kind == 2:
        req.token_ids.SetInParent()
        req.token_ids.ids.extend(fdp.ConsumeIntListInRange(fdp.ConsumeIntInRange(0, 40), 0, 2**32 - 1))
    s = cpb.SamplingParams()
    for name in FLOATS:
        if fdp.ConsumeBool():
            setattr(s, name, fdp.ConsumeRegularFloat() if fdp.ConsumeBool() else fdp.ConsumeFloat())
    for name, bits in (("max_tokens", 32), ("logprobs", 32)):
        if fdp.ConsumeBool():
            setattr(s, name, fdp.ConsumeIntInRange(0, 2**bits - 1))
    if fdp.ConsumeBool():
        s.top_k = fdp.ConsumeIntInRange(-(2**31), 2**31 - 1)
    s.stop_token_ids.extend(fdp.ConsumeIntListInRange(fdp.ConsumeIntInRange(0, 300), 0, 2**32 - 1))
    req.sampling.CopyFrom(s)
    req.stop.extend(text(300) for _ in range(fdp.ConsumeIntInRange(0, 18)))
    return req


def request_target(data: bytes) -> None:
    fdp = atheris.FuzzedDataProvider(data)
    prompt_len = fdp.ConsumeIntInRange(0, 2100)
    if fdp.ConsumeBool():
        req = _built(fdp)
    else:
        try:
            req = gpb.GenerateRequest.FromString(fdp.ConsumeBytes(fdp.remaining_bytes()))
        except DecodeError:
            return
    try:
        valid = validate(req, LIMITS)
        check_length(valid, prompt_len, LIMITS)
    except InvalidRequest as exc:
        assert str(exc)


_tokenizer: TextTokenizer | None = None


def detokenizer_target(data: bytes) -> None:
    fdp = atheris.FuzzedDataProvider(data)
    skip = fdp.ConsumeBool()
    chunks = [fdp.ConsumeIntListInRange(fdp.ConsumeIntInRange(0, 5), 0, _tokenizer.vocab_size - 1)
              for _ in range(fdp.ConsumeIntInRange(1, 8))]
    detok = IncrementalDetokenizer(_tokenizer, skip_special_tokens=skip)
    text = "".join(detok.push(c) for c in chunks) + detok.flush()
    whole = _tokenizer.decode([i for c in chunks for i in c], skip_special_tokens=skip)
    assert text == whole, (chunks, text, whole)


def main() -> None:
    global _tokenizer
    target = sys.argv.pop(1) if len(sys.argv) > 1 else ""
    if target == "request":
        run = request_target
    elif target == "detokenizer":
        _tokenizer = TextTokenizer(os.environ["TANDEM_FUZZ_MODEL"])
        run = detokenizer_target
    else:
        raise SystemExit("usage: fuzz_inputs.py request|detokenizer [libFuzzer flags]")
    atheris.Setup(sys.argv, run)
    atheris.Fuzz()


if __name__ == "__main__":
    main()
