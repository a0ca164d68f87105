"""Protobuf <-> engine dataclasses, at the edge of every service (generated types stay out of the engine).

Nothing here imports torch: the gateway validates sampling parameters with the
engine's own ``SamplingParams`` without loading a model.
"""

from __future__ import annotations

from collections.abc import Sequence

from engine.request import TokenLogprobs
from engine.sampling_params import SamplingParams
from engine.structured.spec import StructuredOutput
from protos import common_pb2 as cpb

FINISH_REASONS = {
    "stop": cpb.FINISH_REASON_STOP,
    "length": cpb.FINISH_REASON_LENGTH,
    "prefilled": cpb.FINISH_REASON_PREFILLED,
    "grammar_error": cpb.FINISH_REASON_GRAMMAR_ERROR,
}
FINISH_NAMES = {v: k for k, v in FINISH_REASONS.items()}


def sampling_from_pb(p: cpb.SamplingParams, default_max_tokens: int) -> SamplingParams:
    """The engine's parameters; unset fields take the engine's defaults. Raises ValueError on bad values."""
    kwargs = {}
    for name in ("temperature", "top_k", "top_p", "min_p", "repetition_penalty", "presence_penalty",
                 "frequency_penalty", "seed", "logprobs"):
        if p.HasField(name):
            kwargs[name] = getattr(p, name)
    max_tokens = p.max_tokens if p.HasField("max_tokens") else default_max_tokens
    return SamplingParams(
        max_tokens=max_tokens,
        stop_token_ids=list(p.stop_token_ids),
        ignore_eos=p.ignore_eos,
        structured=structured_from_pb(p.structured) if p.HasField("structured") else None,
        speculative=p.speculative if p.HasField("speculative") else True,
        **kwargs,
    )


def structured_from_pb(p: cpb.StructuredOutput) -> StructuredOutput:
    """Raises ValueError when no kind is set or its value is malformed (``StructuredOutput``)."""
    kind = p.WhichOneof("kind")
    if kind is None:
        raise ValueError("structured: set one of json_schema, json_object, regex, choice, grammar")
    if kind == "choice":
        return StructuredOutput(kind, choices=tuple(p.choice.choices))
    if kind == "json_object":
        if not p.json_object:
            raise ValueError("structured: json_object must be true when set")
        return StructuredOutput(kind)
    return StructuredOutput(kind, getattr(p, kind))


def structured_to_pb(s: StructuredOutput) -> cpb.StructuredOutput:
    if s.kind == "choice":
        return cpb.StructuredOutput(choice=cpb.Choices(choices=s.choices))
    if s.kind == "json_object":
        return cpb.StructuredOutput(json_object=True)
    return cpb.StructuredOutput(**{s.kind: s.value})


def sampling_to_pb(s: SamplingParams) -> cpb.SamplingParams:
    """Every field set explicitly, so a worker never falls back to a default the gateway did not validate."""
    p = cpb.SamplingParams(
        max_tokens=s.max_tokens,
        temperature=s.temperature,
        top_k=s.top_k,
        top_p=s.top_p,
        min_p=s.min_p,
        repetition_penalty=s.repetition_penalty,
        presence_penalty=s.presence_penalty,
        frequency_penalty=s.frequency_penalty,
        stop_token_ids=s.stop_token_ids,
        ignore_eos=s.ignore_eos,
        speculative=s.speculative,
    )
    if s.seed is not None:
        p.seed = s.seed
    if s.logprobs is not None:
        p.logprobs = s.logprobs
    if s.structured is not None:
        p.structured.CopyFrom(structured_to_pb(s.structured))
    return p


def logprob_to_pb(lp: TokenLogprobs) -> cpb.TokenLogprob:
    return cpb.TokenLogprob(
        token_id=lp.token_id,
        logprob=lp.logprob,
        rank=lp.rank,
        top=[cpb.TopLogprob(token_id=t, logprob=v) for t, v in lp.top],
    )


def token_output(token_ids: Sequence[int], logprobs: Sequence[TokenLogprobs]) -> cpb.TokenOutput:
    return cpb.TokenOutput(token_ids=token_ids, logprobs=[logprob_to_pb(lp) for lp in logprobs])


def finish_reason(name: str | None) -> int:
    return FINISH_REASONS.get(name or "", cpb.FINISH_REASON_UNSPECIFIED)
