"""``tandem bench spec`` on a tiny model: the figures it reports come from real runs and its outputs agree."""

from __future__ import annotations

import random

from engine import Engine
from tandem.bench.spec import bench_engine, format_table, summarise


def test_the_bench_compares_each_method_with_no_speculation(tiny_llama):
    rng = random.Random(0)
    phrase = [rng.randrange(3, 250) for _ in range(6)]
    workloads = {"input-grounded": [phrase * 4 for _ in range(2)],
                 "random": [[rng.randrange(3, 250) for _ in range(24)] for _ in range(2)]}
    results = {}
    for method in ("none", "ngram", "draft"):
        engine = Engine.from_model(str(tiny_llama), num_kv_blocks=128, speculative_method=method,
                                   speculative_model=str(tiny_llama) if method == "draft" else None)
        results[method] = bench_engine(engine, workloads, [2], output_len=12)
    rows = summarise(results, ["ngram", "draft"], [2])
    assert [(r["method"], r["workload"]) for r in rows] == [
        ("ngram", "input-grounded"), ("ngram", "random"), ("draft", "input-grounded"), ("draft", "random")]
    assert all(r["same_output"] for r in rows), "speculation never changes greedy output"
    draft = rows[2]
    assert draft["acceptance"] > 0.5 and draft["mean_accepted_len"] > 1, "the target agrees with its own guesses"
    assert all(r["single_tok_s"] > 0 and r["batch2_tok_s"] > 0 for r in rows)
    table = format_table(rows, [2])
    assert table.count("\n") == 5 and "| ngram | input-grounded |" in table
