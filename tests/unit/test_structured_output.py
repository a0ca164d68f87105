"""Structured outputs in one engine: sampled outputs follow their schema, regex, choice or grammar; the masks
touch only the constrained rows; a matcher continues from tokens generated elsewhere; chunked prefill,
preemption and prefix caching keep the constraint; a dead end ends the request with a reason.

The model is a tiny random Llama with the default model's vocabulary and tokenizer: its logits are
noise, so every structural token comes from the grammar, which is what is under test (the default
model under ``tandem up`` is in tests/e2e/test_structured_outputs.py, with "any JSON object", whose
unbounded strings only a real model closes).
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import jsonschema
import pytest
import torch
from tokenizers import Tokenizer

from engine import Engine, SamplingParams
from engine.async_engine import AsyncEngine
from engine.request import RequestOptions
from engine.structured import StructuredOutput, check_structured
from engine.structured.bitmask import GrammarBitmask
from engine.structured.compiler import GrammarCompiler
from engine.structured.spec import MAX_SPEC_BYTES
from tandem.bench.schemas import SCHEMAS
from tests.conftest import _save_tiny

VOCAB = 49152  # the default model's: its tokenizer.json describes the model's vocabulary
EOS = 2


@pytest.fixture(scope="module")
def model(tmp_path_factory, default_model: Path) -> Path:
    path = _save_tiny(tmp_path_factory.mktemp("tiny-vocab"), "llama", vocab_size=VOCAB, eos_token_id=EOS)
    shutil.copy(default_model / "tokenizer.json", path / "tokenizer.json")
    return path


@pytest.fixture(scope="module")
def engine(model: Path) -> Engine:
    return Engine.from_model(str(model), num_kv_blocks=1024)


@pytest.fixture(scope="module")
def tokenizer(model: Path) -> Tokenizer:
    return Tokenizer.from_file(str(model / "tokenizer.json"))


def prompt(tokenizer: Tokenizer, text: str) -> list[int]:
    return tokenizer.encode(f"<|im_start|>user\n{text}<|im_end|>\n<|im_start|>assistant\n").ids


def run(engine: Engine, prompts: list[list[int]], params: list[SamplingParams],
        options: list[RequestOptions] | None = None) -> list[tuple[list[int], str]]:
    """Each request's tokens and finish reason."""
    options = options or [RequestOptions()] * len(prompts)
    ids = [engine.add_request(p, sp, None, o) for p, sp, o in zip(prompts, params, options, strict=True)]
    tokens: dict[str, list[int]] = {i: [] for i in ids}
    reasons: dict[str, str] = {}
    while engine.has_unfinished():
        for out in engine.step():
            tokens[out.request_id].extend(out.new_token_ids)
            if out.finished:
                reasons[out.request_id] = out.finish_reason
    return [(tokens[i], reasons[i]) for i in ids]


def schema_params(schema: dict, seed: int, max_tokens: int = 400) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=1.0, seed=seed,
                          structured=StructuredOutput("json_schema", json.dumps(schema)))


def test_every_schema_shape_validates_at_temperature_one(engine, tokenizer):
    prompts, params, names = [], [], []
    for name, (question, schema) in SCHEMAS.items():
        for seed in range(3):
            prompts.append(prompt(tokenizer, question))
            params.append(schema_params(schema, seed))
            names.append(name)
    results = run(engine, prompts, params)
    for name, (tokens, reason) in zip(names, results, strict=True):
        text = tokenizer.decode(tokens)
        assert reason == "stop", (name, reason, text)
        jsonschema.validate(json.loads(text), SCHEMAS[name][1])
    assert len({tuple(t) for t, _ in results}) > len(SCHEMAS), "different seeds sample different documents"


@pytest.mark.parametrize("kind, value, choices, check", [
    # [0-9], not \d: xgrammar's \d is every Unicode digit of a newer Unicode than Python 3.11's re knows
    # (U+1CCF6 OUTLINED DIGIT SIX), so re cannot referee it.
    ("regex", r"[A-Z]{2}-[0-9]{3,5}", (), lambda t: re.fullmatch(r"[A-Z]{2}-[0-9]{3,5}", t)),
    ("regex", r"(yes|no), because [a-z ]{1,20}\.", (), lambda t: re.fullmatch(r"(yes|no), because [a-z ]{1,20}\.", t)),
    ("choice", "", ("positive", "negative", "neutral \"quoted\""), lambda t: t in ("positive", "negative",
                                                                                  'neutral "quoted"')),
    ("grammar", 'start: num ("+" num)*\nnum: /[0-9]{1,3}/', (), lambda t: re.fullmatch(r"\d{1,3}(\+\d{1,3})*", t)),
    ("grammar", 'root ::= "(" item ("," item)* ")"\nitem ::= [a-c]', (),
     lambda t: re.fullmatch(r"\([a-c](,[a-c])*\)", t)),
])
def test_regex_choice_and_grammar_outputs_match(engine, tokenizer, kind, value, choices, check):
    spec = StructuredOutput(kind, value, choices)
    params = [SamplingParams(max_tokens=300, temperature=1.0, seed=s, structured=spec) for s in range(4)]
    for tokens, reason in run(engine, [prompt(tokenizer, "Answer.")] * 4, params):
        text = tokenizer.decode(tokens)
        assert reason == "stop" and check(text), (reason, text)


def test_unconstrained_requests_are_unchanged_by_constrained_neighbours(engine, tokenizer):
    p = prompt(tokenizer, "Tell me about the sea.")
    plain = [SamplingParams(max_tokens=24, temperature=0, logprobs=2),
             SamplingParams(max_tokens=24, temperature=0.9, top_p=0.9, seed=7)]
    alone = run(engine, [p, p], plain)
    schema = SCHEMAS["order"][1]
    mixed = run(engine, [p] * 6, [plain[0], schema_params(schema, 1), plain[1], schema_params(schema, 2),
                                  SamplingParams(max_tokens=24, temperature=1.0, seed=3,
                                                 structured=StructuredOutput("regex", "[0-9]+")),
                                  schema_params(schema, 3)])
    assert [mixed[0], mixed[2]] == alone


def test_a_matcher_continues_from_tokens_generated_elsewhere(engine, tokenizer):
    """A decode worker, or the one a stream migrates to, gets the tokens so far and goes on as if uninterrupted."""
    p = prompt(tokenizer, SCHEMAS["config"][0])
    params = schema_params(SCHEMAS["config"][1], seed=11)
    [(whole, reason)] = run(engine, [p], [params])
    assert reason == "stop" and len(whole) > 10
    for k in (1, 5, len(whole) // 2):
        [(rest, _)] = run(engine, [p], [params], [RequestOptions(output_token_ids=whole[:k])])
        assert whole[:k] + rest == whole, f"continued after {k} tokens"


def test_tokens_so_far_that_break_the_grammar_are_refused(engine, tokenizer):
    params = schema_params(SCHEMAS["shirt"][1], seed=0)
    broken = tokenizer.encode('{"colour"', add_special_tokens=False).ids
    with pytest.raises(ValueError, match="do not follow the structured-output constraint"):
        engine.add_request(prompt(tokenizer, "Pick."), params, None, RequestOptions(output_token_ids=broken))
    assert not engine.has_unfinished()


def test_chunked_prefill_preemption_and_prefix_caching_keep_the_constraint(model, engine, tokenizer):
    """A cache too small for the batch preempts; long prompts prefill in chunks; a repeated prompt hits the
    prefix cache. The seeded outputs equal those of a roomy engine, and validate."""
    context = "Here is some context. " * 30 + SCHEMAS["order"][0]
    prompts = [prompt(tokenizer, f"Request {i}. {context}") for i in range(6)]
    prompts.insert(2, prompts[0])  # served from the prefix cache: it arrives while the first is still running
    params = [schema_params(SCHEMAS["order"][1], seed, max_tokens=250) for seed in range(7)]
    expected = run(engine, prompts, params)
    tight = Engine.from_model(str(model), num_kv_blocks=40, max_num_batched_tokens=128)
    got = run(tight, prompts, params)
    assert tight.stats.num_preemptions > 0 and tight.stats.prefix_cache.hit_tokens > 0
    assert got == expected
    for tokens, _ in got:
        jsonschema.validate(json.loads(tokenizer.decode(tokens)), SCHEMAS["order"][1])


def test_a_grammar_that_reaches_its_limits_ends_with_grammar_error(model, engine, tokenizer):
    """The matcher's parser limits stop it a few tokens in: the request ends with a reason, not with an
    unconstrained token."""
    mc = engine.model_config
    strict = GrammarCompiler(model / "tokenizer.json", mc.vocab_size, mc.eos_token_ids, limits={"max_lexer_states": 3})
    spec = StructuredOutput("json_schema", json.dumps(SCHEMAS["person"][1]))
    params = SamplingParams(max_tokens=50, temperature=1.0, seed=0, structured=spec)
    errors = engine.stats.grammar_errors
    [(tokens, reason)] = run(engine, [prompt(tokenizer, "Who?")], [params],
                             [RequestOptions(grammar=strict.compile(spec))])
    assert reason == "grammar_error" and engine.stats.grammar_errors == errors + 1
    assert 1 <= len(tokens) < 50 and tokenizer.decode(tokens).startswith("{")


def test_compiled_grammars_are_cached_by_their_text(engine, tokenizer):
    grammars = engine.grammars
    spec = StructuredOutput("regex", "cached-[0-9]{4}")
    compiles, hits = grammars.compiles, grammars.cache_hits
    params = [SamplingParams(max_tokens=20, temperature=1.0, seed=s, structured=spec) for s in range(3)]
    run(engine, [prompt(tokenizer, "Go.")] * 3, params)
    assert (grammars.compiles, grammars.cache_hits) == (compiles + 1, hits + 2)
    run(engine, [prompt(tokenizer, "Go.")], [SamplingParams(max_tokens=20, structured=StructuredOutput("regex", "x+"))])
    assert grammars.compiles == compiles + 2


@pytest.mark.parametrize("kind, value, choices, message", [
    ("regex", "a(", (), "unclosed group"),
    ("json_schema", '{"type": "object", "properties": {"a": {"$ref": "#/$defs/nope"}}}', (), "/$defs/nope"),
    ("json_schema", '{"type": "strin"}', (), "strin"),
    ("grammar", "start: undefined_rule", (), "undefined_rule"),
    ("grammar", 'root ::= "a" (', (), "grammar"),
])
def test_a_constraint_that_does_not_compile_names_its_problem(engine, tokenizer, kind, value, choices, message):
    spec = StructuredOutput(kind, value, choices)
    with pytest.raises(ValueError, match="does not compile") as gateway_side:
        check_structured(spec)
    assert message in str(gateway_side.value)
    with pytest.raises(ValueError, match="does not compile"):
        engine.add_request(prompt(tokenizer, "x"), SamplingParams(structured=spec))
    assert not engine.has_unfinished()


@pytest.mark.parametrize("kwargs, message", [
    (dict(kind="xml"), "kind must be one of"),
    (dict(kind="json_schema", value="{not json"), "not valid JSON"),
    (dict(kind="json_schema", value="[1, 2]"), "must be a JSON object"),
    (dict(kind="choice"), "at least one string"),
    (dict(kind="choice", choices=("a", "")), "non-empty strings"),
    (dict(kind="regex"), "is empty"),
    (dict(kind="grammar", value="x" * (MAX_SPEC_BYTES + 1)), f"at most {MAX_SPEC_BYTES}"),
])
def test_malformed_constraints_are_refused_before_compiling(kwargs, message):
    with pytest.raises(ValueError, match=message):
        StructuredOutput(**kwargs)


def test_the_async_engine_compiles_before_the_request_enters_the_engine(model, tokenizer):
    async_engine = AsyncEngine(Engine.from_model(str(model), num_kv_blocks=256, grammar_compile_timeout_s=1e-6))
    spec = StructuredOutput("json_schema", json.dumps(SCHEMAS["config"][1]))

    async def collect(params: SamplingParams) -> list[int]:
        return [t async for out in async_engine.generate(prompt(tokenizer, "x"), params, f"r{id(params)}")
                for t in out.new_token_ids]

    import asyncio

    try:
        with pytest.raises(ValueError, match="did not compile within"):
            asyncio.run(collect(SamplingParams(max_tokens=50, structured=spec)))
        assert async_engine.num_compiling == 0
        async_engine.engine.grammars.compile_timeout_s = 10.0
        tokens = asyncio.run(collect(SamplingParams(max_tokens=200, temperature=1.0, seed=1, structured=spec)))
        jsonschema.validate(json.loads(tokenizer.decode(tokens)), SCHEMAS["config"][1])
        with pytest.raises(ValueError, match="does not compile"):
            asyncio.run(collect(SamplingParams(structured=StructuredOutput("regex", "(("))))
    finally:
        async_engine.shutdown()


def test_masks_match_llguidance_and_leave_other_rows_untouched(engine):
    """The applied mask equals llguidance's own bitmask (another of its entry points); unconstrained rows keep
    their exact bits; columns past the tokenizer's vocabulary are banned."""
    grammars = engine.grammars
    specs = [StructuredOutput("json_object"), StructuredOutput("regex", "[a-f]{2,}"),
             StructuredOutput("choice", choices=("alpha", "beta"))]
    states = [grammars.compile(s).new_state() for s in specs]
    width = VOCAB + 64  # an lm_head wider than the tokenizer's vocabulary, as some checkpoints pad it
    torch.manual_seed(0)
    logits = torch.randn(5, width)
    original = logits.clone()
    rows = [0, 2, 4]
    result = GrammarBitmask(VOCAB).apply(logits, list(zip(rows, states, strict=True)))
    assert result.rows == rows and result.dead == {}
    for row, state in zip(rows, states, strict=True):
        bits = torch.frombuffer(bytearray(state.matcher.compute_bitmask()), dtype=torch.uint8)
        allowed = ((bits.unsqueeze(-1) >> torch.arange(8)) & 1).flatten().bool()[:VOCAB]
        assert allowed.any()
        kept = torch.isfinite(logits[row])
        assert torch.equal(kept[:VOCAB], allowed) and not kept[VOCAB:].any()
        assert torch.equal(logits[row][kept], original[row][kept])
    for row in (1, 3):
        assert torch.equal(logits[row], original[row])
