"""``tandem bench quant``: quantized weights (GGUF-direct, int8) against bfloat16 and llama-cpp-python, one run.

On the same GGUF file (the default model's, kept by ``tandem fetch-model``): single-stream decode tokens/s after a
32- and a 1,024-token prompt (time after the first token), prefill tokens/s of 1,024 tokens (time to the first
token), and batched output tokens/s of B streams (128-token random prompts, 128 forced new tokens each, wall time
including prefill: the figure llama.cpp's batched runs give too). Single-stream decode is also set against the
bandwidth roofline: the bytes of weights one token reads (quantized bytes, scales included) over ``torch.sum``'s
read bandwidth, measured in the same run. Perplexity on the bundled 11.5k-token text shows what the speed costs.

llama-cpp-python runs in its own environment (``--llama-python``, as ../shared/peers builds it), with the same
number of threads, through ``tandem/bench/llama_cpp_peer.py``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import sys
import time
from pathlib import Path

import torch

from tandem.bench.offline import DEFAULT_LLAMA_PYTHON, run_llama_peer


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--configs", default="gguf:bfloat16,gguf:float32,int8:bfloat16,none:bfloat16",
                   help="quantization:dtype pairs of tandem to run")
    p.add_argument("--batch-sizes", default="8,32,64")
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--batch-prompt-len", type=int, default=128)
    p.add_argument("--llama-python", default=os.environ.get("TANDEM_LLAMA_PYTHON", DEFAULT_LLAMA_PYTHON),
                   help="a Python with llama-cpp-python (skipped when it has none)")
    p.add_argument("--no-perplexity", action="store_true", help="skip the perplexity column (about 20 s a config)")
    p.add_argument("--output-dir", default="bench-results")


def random_prompt(n: int, vocab: int, rng: random.Random) -> list[int]:
    return [rng.randrange(100, vocab - 100) for _ in range(n)]


def bench_tandem(args: argparse.Namespace, quantization: str, dtype: str, bandwidth: float) -> dict:
    from common.engine_args import engine_config
    from engine import Engine
    from tandem.bench.offline import Workload, single_stream, tandem_batch, weight_bytes

    args.quantization, args.dtype = quantization, dtype
    config = engine_config(args)
    config.max_num_seqs = max(config.max_num_seqs, max(args.sizes))
    engine = Engine(config)
    vocab = config.model_config.vocab_size
    rng = random.Random(0)
    engine.generate([random_prompt(16, vocab, rng)] * 2)  # warm-up
    row: dict = {"config": f"tandem {quantization} {dtype}", "bytes_per_token": weight_bytes(engine)}
    _, row["decode_32_tok_s"] = single_stream(engine, random_prompt(32, vocab, rng), args.new_tokens)
    ttft, row["decode_1024_tok_s"] = single_stream(engine, random_prompt(1024, vocab, rng), args.new_tokens)
    row["prefill_1024_tok_s"] = 1024 / ttft
    row["roofline_fraction_32"] = row["decode_32_tok_s"] / (bandwidth * 1e9 / row["bytes_per_token"])
    row["batch"] = {}
    for b in args.sizes:
        batch_rng = random.Random(b)
        prompts = [random_prompt(args.batch_prompt_len, vocab, batch_rng) for _ in range(b)]
        row["batch"][str(b)] = tandem_batch(engine, Workload(prompts, [args.new_tokens] * b))
    assert engine.num_free_blocks == engine.num_total_blocks
    del engine
    if not args.no_perplexity:
        from tandem.bench.perplexity import perplexity, text_tokens

        row["perplexity"] = perplexity(config, text_tokens(config.model), decode_kernels=True)
    print(f"  {row['config']}: {json.dumps(row)}", file=sys.stderr)
    return row


def bench_llama_cpp(args: argparse.Namespace, gguf: Path, threads: int) -> dict | None:
    if not Path(args.llama_python).is_file():
        print(f"  llama-cpp-python: no {args.llama_python} (build it as ../shared/peers/bench_peers.sh does, or "
              "pass --llama-python): skipped", file=sys.stderr)
        return None
    peer = run_llama_peer(args.llama_python, gguf, threads, "--new-tokens", str(args.new_tokens),
                          "--batch-sizes", ",".join(map(str, args.sizes)),
                          "--batch-prompt-len", str(args.batch_prompt_len))
    peer["config"] = f"llama-cpp-python {peer.pop('version')} {gguf.name}"
    peer["batch_decode_phase"] = {b: v["decode_phase_tok_s"] for b, v in peer["batch"].items()}
    peer["batch"] = {b: v["out_tok_s"] for b, v in peer["batch"].items()}
    print(f"  {peer['config']}: {json.dumps(peer)}", file=sys.stderr)
    return peer


def run(args: argparse.Namespace) -> int:
    from common.engine_args import engine_config
    from tandem.bench.offline import read_bandwidth_gbps

    args.sizes = [int(b) for b in args.batch_sizes.split(",") if b]
    args.quantization = "gguf"
    gguf = Path(engine_config(args).gguf_file or "")
    threads = args.num_threads or torch.get_num_threads()
    bandwidth = read_bandwidth_gbps(threads)
    torch.set_num_threads(threads)
    print(f"read bandwidth {bandwidth:.1f} GB/s ({threads} threads); GGUF {gguf}", file=sys.stderr)
    rows = []
    peer = bench_llama_cpp(args, gguf, threads)
    for pair in [c for c in args.configs.split(",") if c]:
        quantization, dtype = pair.split(":")
        rows.append(bench_tandem(args, quantization, dtype, bandwidth))
    if peer is not None:
        peer["roofline_fraction_32"] = peer["decode_32_tok_s"] / (bandwidth * 1e9 / gguf.stat().st_size)
        rows.append(peer)
    print(format_table(rows, args.sizes, peer))
    write_json(args, rows, bandwidth, threads)
    return 0


def format_table(rows: list[dict], sizes: list[int], peer: dict | None) -> str:
    head = ["", "decode tok/s @32", "decode tok/s @1024", "prefill tok/s @1024",
            *[f"batch {b} out tok/s" for b in sizes], "roofline @32", "perplexity"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        ref = peer if peer is not None and r is not peer else None
        cells = [r["config"], _cell(r["decode_32_tok_s"], ref and ref["decode_32_tok_s"]),
                 _cell(r["decode_1024_tok_s"], ref and ref["decode_1024_tok_s"]),
                 _cell(r["prefill_1024_tok_s"], ref and ref["prefill_1024_tok_s"]),
                 *[_cell(r["batch"][str(b)], ref and max(ref["batch"].values())) for b in sizes],
                 f"{r['roofline_fraction_32']:.0%}", f"{r['perplexity']:.3f}" if "perplexity" in r else "-"]
        lines.append("| " + " | ".join(cells) + " |")
    note = "ratios: against llama-cpp-python (batched: against its best batch size)" if peer else ""
    return "\n".join(lines) + ("\n" + note if note else "")


def _cell(value: float, reference: float | None) -> str:
    """A figure, with its ratio to the peer's when there is one."""
    return f"{value:.1f} ({value / reference:.2f}x)" if reference else f"{value:.1f}"


def write_json(args: argparse.Namespace, rows: list[dict], bandwidth: float, threads: int) -> None:
    out = Path(args.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"quant-{time.strftime('%Y%m%d-%H%M%S')}.json"
    meta = {"machine": platform.processor() or platform.machine(), "cpu": _cpu_model(), "threads": threads,
            "read_bandwidth_gbps": bandwidth, "torch": torch.__version__}
    path.write_text(json.dumps({"meta": meta, "rows": rows}, indent=2) + "\n")
    print(f"wrote {path}", file=sys.stderr)


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), "")
    except OSError:
        return ""
