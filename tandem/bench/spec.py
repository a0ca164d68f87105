"""``tandem bench spec``: speculative decoding on against off, in-process, in one run.

Two workloads: input-grounded (the answer copies from a long prompt: repeat it, correct its typos, extract
its sentences about one subject; greedy), where prompt lookup finds what comes next; and random prompts
sampled at temperature 1.0 (seeded), where guesses are mostly wrong and the back-off must keep the cost
near zero. For each method (ngram; draft, with
``--draft-model``, by default the model itself, which shows the acceptance ceiling and the overhead of a
draft as large as the target), and without speculation: single-stream decode tokens/s (time after the
first token), and batched decode tokens/s at each of ``--batch-sizes`` streams (after every stream has its
first token; every request its fixed length: ``ignore_eos``). Acceptance rate (accepted / proposed) and
mean accepted length (tokens per verification: accepted + 1) come from the engine's own counters.
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import sys
import time
from pathlib import Path

import torch

PASSAGE = (
    "The harbour town of Elmsworth grew around a single stone pier built in 1852. Fishing boats left before "
    "dawn and came back at noon, and the market on the quay sold their catch until the bell of the church "
    "rang four. In 1901 the railway reached the town, and with it came visitors from the capital who walked "
    "along the cliffs and bought painted shells from the children. The old lighthouse was replaced in 1923 by "
    "a taller tower of white brick, whose lamp could be seen thirty kilometres out at sea. During the long "
    "winter of 1947 the harbour froze for the first time in living memory, and the boats stayed tied to the "
    "pier for six weeks. Today the town has a museum of the sea, two schools, a library with a garden, and a "
    "ferry that crosses to the islands three times a day in summer and once a day in winter."
)
TASKS = (
    "Repeat the following text exactly, word for word:\n\n{text}",
    "The following text may contain typos. Rewrite it with every typo corrected and nothing else changed:\n\n"
    "{text}",
    "Copy every sentence of the following text that mentions the harbour or the boats, unchanged:\n\n{text}",
)


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--methods", default="ngram,draft", help="comma-separated: ngram, draft")
    p.add_argument("--draft-model", default=None, help="the draft's folder (default: the model itself)")
    p.add_argument("--spec-tokens", type=int, default=4, help="tokens proposed per step")
    p.add_argument("--batch-sizes", default="8,32")
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--output-dir", default="bench-results")


def grounded_prompts(tokenizer, n: int) -> list[list[int]]:
    """Chat prompts whose answers copy the passage, cycling over the tasks."""
    return [tokenizer.encode_chat([{"role": "user", "content": TASKS[i % len(TASKS)].format(text=PASSAGE)}])
            for i in range(n)]


def random_prompts(vocab: int, n: int, length: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(100, vocab - 100) for _ in range(length)] for _ in range(n)]


def sampling(workload: str, output_len: int, index: int):
    """Greedy on the input-grounded prompts; temperature 1.0, seeded, on the random ones (guesses go wrong
    there: the back-off's case), so that outputs can still be compared with speculation off."""
    from engine import SamplingParams

    if workload == "random":
        return SamplingParams(max_tokens=output_len, temperature=1.0, seed=index, ignore_eos=True)
    return SamplingParams(max_tokens=output_len, temperature=0, ignore_eos=True)


def measure(engine, prompts: list[list[int]], output_len: int, workload: str = "input-grounded") -> dict:
    """Decode tokens/s of ``prompts`` run together, from the moment every one has its first token (what
    speculation changes; their prefills are the same either way), and the speculation counters' change."""
    ids = [engine.add_request(p, sampling(workload, output_len, i)) for i, p in enumerate(prompts)]
    outs: dict[str, list[int]] = {i: [] for i in ids}
    before, start, at_start = _spec_counts(engine), None, 0
    while engine.has_unfinished():
        for out in engine.step():
            outs[out.request_id] += out.new_token_ids
        if start is None and all(outs.values()):
            start, at_start, before = time.perf_counter(), sum(map(len, outs.values())), _spec_counts(engine)
    elapsed = time.perf_counter() - start
    drafts, drafted, accepted = (a - b for a, b in zip(_spec_counts(engine), before, strict=True))
    decoded = sum(map(len, outs.values())) - at_start
    return {"out_tok_s": decoded / elapsed, "drafts": drafts, "draft_tokens": drafted,
            "accepted_tokens": accepted, "outputs": [outs[i] for i in ids]}


def single_decode(engine, prompt: list[int], output_len: int, workload: str = "input-grounded"
                  ) -> tuple[float, list[int]]:
    """Decode tokens/s of one stream (the time after its first token) and its tokens."""
    rid = engine.add_request(prompt, sampling(workload, output_len, 0))
    tokens: list[int] = []
    first = None
    while engine.has_unfinished():
        for out in engine.step():
            if out.request_id == rid:
                tokens += out.new_token_ids
                if first is None:
                    first, first_count = time.perf_counter(), len(tokens)
    return (len(tokens) - first_count) / (time.perf_counter() - first), tokens


def _spec_counts(engine) -> tuple[int, int, int]:
    if engine.spec is None:
        return 0, 0, 0
    s = engine.spec.stats
    return s.num_drafts, s.num_draft_tokens, s.num_accepted_tokens


def bench_engine(engine, workloads: dict[str, list[list[int]]], sizes: list[int], output_len: int) -> dict:
    """Every workload: single-stream decode, then each batch size; counters summed over the workload."""
    result = {}
    for name, prompts in workloads.items():
        tok_s, tokens = single_decode(engine, prompts[0], output_len, name)
        row = {"single_decode_tok_s": tok_s, "single_tokens": tokens}
        counts = [0, 0, 0]
        for size in sizes:
            m = measure(engine, prompts[:size], output_len, name)
            row[f"batch{size}_out_tok_s"] = m["out_tok_s"]
            row[f"batch{size}_outputs"] = m["outputs"]
            for i, key in enumerate(("drafts", "draft_tokens", "accepted_tokens")):
                counts[i] += m[key]
        row["drafts"], row["draft_tokens"], row["accepted_tokens"] = counts
        result[name] = row
    return result


def run(args: argparse.Namespace) -> int:
    from common.engine_args import engine_config, resolve_model
    from engine import Engine
    from tokenizer_svc.tokenizer import TextTokenizer

    sizes = [int(x) for x in args.batch_sizes.split(",") if x]
    methods = [m for m in args.methods.split(",") if m]
    model = resolve_model(args.model)
    tokenizer = TextTokenizer(model)
    base = engine_config(args)
    n = max(sizes)
    grounded = grounded_prompts(tokenizer, n)
    workloads = {"input-grounded": grounded,
                 "random": random_prompts(base.model_config.vocab_size, n, len(grounded[0]), args.seed)}
    results = {}
    for method in ["none", *methods]:
        config = engine_config(args)
        config.speculative_method = method
        config.num_speculative_tokens = args.spec_tokens
        if method == "draft":
            config.speculative_model = str(args.draft_model or model)
        engine = Engine(config)
        print(f"  {method} ...", file=sys.stderr)
        results[method] = bench_engine(engine, workloads, sizes, args.output_len)
        del engine
    rows = summarise(results, methods, sizes)
    print(format_table(rows, sizes))
    write_json(args, results, rows)
    return 0


def summarise(results: dict, methods: list[str], sizes: list[int]) -> list[dict]:
    """One row per (method, workload): figures, their ratios to no speculation, whether outputs matched."""
    rows = []
    for method in methods:
        for workload, r in results[method].items():
            off = results["none"][workload]
            row = {"method": method, "workload": workload,
                   "single_tok_s": r["single_decode_tok_s"], "single_off_tok_s": off["single_decode_tok_s"],
                   "single_ratio": r["single_decode_tok_s"] / off["single_decode_tok_s"],
                   "acceptance": r["accepted_tokens"] / r["draft_tokens"] if r["draft_tokens"] else None,
                   "mean_accepted_len": (r["accepted_tokens"] + r["drafts"]) / r["drafts"] if r["drafts"] else None,
                   "same_output": r["single_tokens"] == off["single_tokens"]
                   and all(r[f"batch{s}_outputs"] == off[f"batch{s}_outputs"] for s in sizes)}
            for s in sizes:
                row[f"batch{s}_tok_s"] = r[f"batch{s}_out_tok_s"]
                row[f"batch{s}_ratio"] = r[f"batch{s}_out_tok_s"] / off[f"batch{s}_out_tok_s"]
            rows.append(row)
    return rows


def format_table(rows: list[dict], sizes: list[int]) -> str:
    def f(v, fmt="{:.1f}"):
        return "-" if v is None else fmt.format(v)

    head = ("| method | workload | 1-stream decode tok/s (off) | ratio | "
            + " | ".join(f"batch {s} decode tok/s | ratio" for s in sizes)
            + " | acceptance | mean accepted length | same tokens |")
    lines = [head, "|" + "---|" * (7 + 2 * len(sizes))]
    for r in rows:
        batches = " | ".join(f"{f(r[f'batch{s}_tok_s'])} | {f(r[f'batch{s}_ratio'], '{:.2f}x')}" for s in sizes)
        lines.append(f"| {r['method']} | {r['workload']} | {f(r['single_tok_s'])} ({f(r['single_off_tok_s'])}) | "
                     f"{f(r['single_ratio'], '{:.2f}x')} | {batches} | {f(r['acceptance'], '{:.0%}')} | "
                     f"{f(r['mean_accepted_len'], '{:.2f}')} | {'yes' if r['same_output'] else 'NO'} |")
    return "\n".join(lines)


def write_json(args: argparse.Namespace, results: dict, rows: list[dict]) -> None:
    out = Path(args.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"spec-{time.strftime('%Y%m%d-%H%M%S')}.json"
    settings = {k: v for k, v in vars(args).items() if k != "func"}
    doc = {"bench": "spec", "machine": platform.processor() or platform.machine(), "torch": torch.__version__,
           "threads": torch.get_num_threads(), "settings": settings, "rows": rows,
           "raw": {m: {w: {k: v for k, v in r.items() if k != "single_tokens" and not k.endswith("_outputs")}
                       for w, r in per.items()} for m, per in results.items()}}
    path.write_text(json.dumps(doc, indent=2, default=str))
    print(f"wrote {path}", file=sys.stderr)
