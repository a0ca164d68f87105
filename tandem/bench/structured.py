"""``tandem bench structured``: what structured outputs cost, in-process, in one run.

1. Per-step overhead at each of ``--batch-sizes``: a batch of decodes runs ``--steps`` steps unconstrained,
   then the same batch constrained by the JSON schemas of ``tandem.bench.schemas`` (cycled), alternating
   ``--repeats`` times so both see the same machine. Constrained requests end when their JSON is complete,
   unconstrained ones after 40 tokens (about as long); each one that ends is replaced at once by a new one,
   and only steps in which every request of the batch decodes (no prefill of a newcomer) are timed, so
   both sides time the same kind of step over contexts of about the same lengths. Reported: median
   step time of each, the overhead, and the constraint work itself (filling and applying the masks) per
   step (and its share of an unconstrained step: the overhead without the machine's noise) and per
   constrained row.
2. Compile time per schema: the first compile (cache miss; the tokenizer's token trie is built once before,
   timed on its own), a cached compile (lookup and the request's copy of the matcher), and the gateway's
   check (without tokenizer), first and cached.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

from tandem.bench.schemas import SCHEMAS

TARGET_OVERHEAD_AT_32 = 0.10
UNCONSTRAINED_TOKENS = 40  # the schemas' answers take 10 to 60 tokens


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--batch-sizes", default="1,8,32")
    p.add_argument("--steps", type=int, default=24, help="timed decode steps per side and repeat")
    p.add_argument("--repeats", type=int, default=4, help="unconstrained/constrained alternations per batch size")
    p.add_argument("--output-dir", default="bench-results")


class StepTimer:
    """Wraps one engine's constraint work, so a step's share of it is known."""

    def __init__(self, engine) -> None:
        self.engine = engine
        self.seconds = 0.0
        self.rows = 0
        inner = engine._constrain

        def timed(logits, requests):
            start = time.perf_counter()
            try:
                return inner(logits, requests)
            finally:
                self.seconds += time.perf_counter() - start
                self.rows += sum(r.grammar is not None for r in requests)

        engine._constrain = timed


class Batch:
    """``size`` requests kept running: each that ends is replaced by a fresh one of the same kind."""

    def __init__(self, engine, prompts: list[list[int]], size: int, constrained: bool) -> None:
        from engine import SamplingParams
        from engine.structured import StructuredOutput

        self.engine, self.prompts, self.constrained = engine, prompts, constrained
        self.specs = [StructuredOutput("json_schema", json.dumps(schema)) for _, schema in SCHEMAS.values()]
        self.params = SamplingParams
        self.started = 0
        self.seen: set[str] = set()
        self.ids = [self._add() for _ in range(size)]

    def _add(self) -> str:
        i = self.started
        self.started += 1
        if self.constrained:
            kwargs = {"structured": self.specs[i % len(self.specs)], "max_tokens": 400}
        else:  # as long as a constrained answer, about: both sides attend over contexts of the same lengths
            kwargs = {"ignore_eos": True, "max_tokens": UNCONSTRAINED_TOKENS}
        params = self.params(temperature=1.0, seed=i, **kwargs)
        return self.engine.add_request(self.prompts[i % len(self.prompts)], params)

    def step(self) -> tuple[float, bool]:
        """One engine step: its time, and whether every request of the batch decoded in it."""
        start = time.perf_counter()
        outs = self.engine.step()
        elapsed = time.perf_counter() - start
        pure = len(outs) == len(self.ids) and all(o.request_id in self.seen for o in outs)
        for o in outs:
            self.seen.add(o.request_id)
            if o.finished:
                self.ids[self.ids.index(o.request_id)] = self._add()
        return elapsed, pure

    def close(self) -> None:
        for rid in self.ids:
            self.engine.abort(rid)


def time_steps(engine, timer: StepTimer, prompts: list[list[int]], size: int, constrained: bool,
               steps: int) -> tuple[list[float], float, int]:
    """Times of ``steps`` pure decode steps, and the constraint work (seconds, rows) within them."""
    batch = Batch(engine, prompts, size, constrained)
    times: list[float] = []
    work, rows = 0.0, 0
    for _ in range(steps * 20):
        if len(times) == steps:
            break
        before = (timer.seconds, timer.rows)
        elapsed, pure = batch.step()
        if pure:
            times.append(elapsed)
            work += timer.seconds - before[0]
            rows += timer.rows - before[1]
    batch.close()
    return times, work, rows


def step_overhead(engine, prompts: list[list[int]], sizes: list[int], steps: int, repeats: int) -> list[dict]:
    timer = StepTimer(engine)
    rows = []
    for size in sizes:
        plain: list[float] = []
        constrained: list[float] = []
        work, masked = 0.0, 0
        for _ in range(repeats):
            plain += time_steps(engine, timer, prompts, size, False, steps)[0]
            t, w, r = time_steps(engine, timer, prompts, size, True, steps)
            constrained += t
            work, masked = work + w, masked + r
        p, c = statistics.median(plain), statistics.median(constrained)
        rows.append({"batch": size, "unconstrained_step_ms": p * 1e3, "constrained_step_ms": c * 1e3,
                     "overhead": c / p - 1, "mask_ms_per_step": work / len(constrained) * 1e3,
                     "mask_share": work / len(constrained) / p,
                     "mask_us_per_row": work / masked * 1e6 if masked else None,
                     "timed_steps": [len(plain), len(constrained)]})
        print(f"  batch {size}: {json.dumps(rows[-1])}", file=sys.stderr)
    return rows


def compile_times(tokenizer_file: Path, vocab_size: int, eos: tuple[int, ...]) -> tuple[float, list[dict]]:
    """Tokenizer load time, then per schema: first and cached compile, first and cached gateway check."""
    from engine.structured import StructuredOutput, check_structured
    from engine.structured.compiler import GrammarCompiler
    from engine.structured.spec import _grammar_error

    compiler = GrammarCompiler(tokenizer_file, vocab_size, eos)
    start = time.perf_counter()
    compiler.compile(StructuredOutput("regex", "x"))  # builds the token trie
    tokenizer_s = time.perf_counter() - start
    _grammar_error.cache_clear()
    rows = []
    for name, (_, schema) in SCHEMAS.items():
        spec = StructuredOutput("json_schema", json.dumps(schema))
        row = {"schema": name, "bytes": len(spec.value)}
        for key, fn in (("compile", lambda s=spec: compiler.compile(s).new_state()),
                        ("gateway_check", lambda s=spec: check_structured(s))):
            for phase in ("first", "cached"):
                start = time.perf_counter()
                fn()
                row[f"{key}_{phase}_ms"] = (time.perf_counter() - start) * 1e3
        rows.append(row)
    return tokenizer_s, rows


def run(args: argparse.Namespace) -> int:
    from common.engine_args import engine_config
    from engine import Engine
    from tokenizer_svc.tokenizer import TextTokenizer

    config = engine_config(args)
    sizes = [int(x) for x in args.batch_sizes.split(",") if x]
    tokenizer = TextTokenizer(config.model)
    prompts = [tokenizer.encode_chat([{"role": "user", "content": f"{q} Answer in JSON."}])
               for q, _ in SCHEMAS.values()]
    mc = config.model_config
    tokenizer_s, compiles = compile_times(Path(config.model) / "tokenizer.json", mc.vocab_size, mc.eos_token_ids)
    engine = Engine(config)
    steps = step_overhead(engine, prompts, sizes, args.steps, args.repeats)
    print(format_tables(steps, tokenizer_s, compiles))
    write_json(args, steps, tokenizer_s, compiles)
    return 0


def format_tables(steps: list[dict], tokenizer_s: float, compiles: list[dict]) -> str:
    lines = ["| batch | unconstrained step | constrained step | overhead | masks per step (share) | mask per row |",
             "|---|---|---|---|---|---|"]
    for r in steps:
        per_row = "-" if r["mask_us_per_row"] is None else f"{r['mask_us_per_row']:.0f} us"
        lines.append(f"| {r['batch']} | {r['unconstrained_step_ms']:.1f} ms | {r['constrained_step_ms']:.1f} ms | "
                     f"{r['overhead']:+.1%} | {r['mask_ms_per_step']:.2f} ms ({r['mask_share']:.1%}) | {per_row} |")
    at32 = [r for r in steps if r["batch"] == 32]
    if at32:
        verdict = "met" if at32[0]["overhead"] <= TARGET_OVERHEAD_AT_32 else "missed"
        lines.append(f"\ntarget: overhead <= {TARGET_OVERHEAD_AT_32:.0%} at batch 32: {verdict}")
    lines += ["", f"tokenizer for grammars (once per worker): {tokenizer_s * 1e3:.0f} ms", "",
              "| schema | bytes | compile, first | compile, cached | gateway check, first | gateway check, cached |",
              "|---|---|---|---|---|---|"]
    for r in compiles:
        lines.append(f"| {r['schema']} | {r['bytes']} | {r['compile_first_ms']:.2f} ms | "
                     f"{r['compile_cached_ms'] * 1e3:.0f} us | {r['gateway_check_first_ms']:.2f} ms | "
                     f"{r['gateway_check_cached_ms'] * 1e3:.0f} us |")
    return "\n".join(lines)


def write_json(args: argparse.Namespace, steps: list[dict], tokenizer_s: float, compiles: list[dict]) -> None:
    out = Path(args.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"structured-{time.strftime('%Y%m%d-%H%M%S')}.json"
    settings = {k: v for k, v in vars(args).items() if k != "func"}
    doc = {"bench": "structured", "machine": platform.processor() or platform.machine(),
           "torch": torch.__version__, "threads": torch.get_num_threads(), "settings": settings,
           "steps": steps, "tokenizer_ms": tokenizer_s * 1e3, "compile": compiles}
    path.write_text(json.dumps(doc, indent=2, default=str))
    print(f"wrote {path}", file=sys.stderr)
