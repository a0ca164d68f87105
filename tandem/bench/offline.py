"""``tandem bench offline``: the engine in-process against transformers, in one run.

Workload (fixed seed): N requests, prompt lengths uniform in [32, 512], output
lengths uniform in [16, 256], ignore_eos, each request counting only its own
output. transformers runs static-batch ``generate`` with left padding at each
batch size of ``--hf-batch-sizes`` and the best one is reported. Single-stream
decode is compared with transformers and with the memory-bandwidth roofline
(weight bytes / read bandwidth, measured here in the same run); batched
throughput with the workload's own roofline (``workload_roofline``, from the
read bandwidth and the GEMM rate measured in the same run).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from tandem.bench.timing import best_of, timed

# llama-cpp-python runs in its own environment, as ../shared/peers builds it (tandem bench quant uses it too)
PEER_SCRIPT = Path(__file__).with_name("llama_cpp_peer.py")
DEFAULT_LLAMA_PYTHON = "/tmp/peers/venv-llama/bin/python"


@dataclass(slots=True)
class Workload:
    prompts: list[list[int]]
    output_lens: list[int]

    @property
    def num_output_tokens(self) -> int:
        return sum(self.output_lens)


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--num-requests", type=int, default=64)
    p.add_argument("--prompt-len", default="32,512", help="min,max prompt tokens")
    p.add_argument("--output-len", default="16,256", help="min,max output tokens")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dtypes", default="float32,bfloat16")
    p.add_argument("--hf-batch-sizes", default="8,16,32,64")
    p.add_argument("--no-hf", action="store_true", help="skip transformers (tandem figures only)")
    p.add_argument("--llama-python", default=os.environ.get("TANDEM_LLAMA_PYTHON", DEFAULT_LLAMA_PYTHON),
                   help="a Python with llama-cpp-python: runs the same workload on the model's GGUF (skipped when "
                   "it has none)")
    p.add_argument("--single-new-tokens", type=int, default=128)
    p.add_argument("--output-dir", default="bench-results")
    p.add_argument("--scenarios", default="throughput,prefix-cache,chunked-prefill,scheduler",
                   help="comma-separated: throughput (against transformers), prefix-cache, chunked-prefill, "
                   "scheduler, step-profile (per-op decode profile at --profile-batches, per dtype)")
    p.add_argument("--profile-batches", default="1,16,64,256", help="batch sizes of the step-profile scenario")
    p.add_argument("--chunk-budget", type=int, default=256,
                   help="token budget per step of the chunked side of the chunked-prefill scenario")


def make_workload(n: int, prompt_range: tuple[int, int], out_range: tuple[int, int], vocab: int, seed: int) -> Workload:
    rng = random.Random(seed)
    prompts = [[rng.randrange(100, vocab - 100) for _ in range(rng.randint(*prompt_range))] for _ in range(n)]
    return Workload(prompts, [rng.randint(*out_range) for _ in range(n)])


def read_bandwidth_gbps(num_threads: int, device: str = "cpu") -> float:
    """Best of 3 ``torch.sum`` passes over 1 GiB of float32 (the peers' roofline method), on ``device``:
    host DRAM on CPU, HBM on a GPU."""
    torch.set_num_threads(num_threads)
    x = torch.ones(1 << 28, dtype=torch.float32, device=device)
    x.sum()
    best = best_of(3, x.sum, device)
    return (1 << 30) / best / 1e9


@dataclass(frozen=True, slots=True)
class BatchRun:
    """One batched run of the workload, its wall time split by the kind of step: the steps that computed prompt
    tokens (decode rows of earlier-admitted requests may ride along in them) and the steps that only decoded, so
    each can be read against its own part of the workload roofline (``prefill_s`` / ``decode_s``)."""

    out_tok_s: float
    prefill_steps: int
    prefill_steps_s: float
    decode_steps: int
    decode_steps_s: float


def tandem_batch_run(engine, work: Workload) -> BatchRun:
    """The workload as one batch, stepped here rather than through ``generate`` so that each step can be told
    apart by whether it computed prompt tokens."""
    from engine import SamplingParams

    params = [SamplingParams(max_tokens=n, temperature=0, ignore_eos=True) for n in work.output_lens]
    steps, seconds = [0, 0], [0.0, 0.0]  # [prefill, decode]
    t = time.perf_counter()
    ids = [engine.add_request(p, sp) for p, sp in zip(work.prompts, params, strict=True)]
    made = dict.fromkeys(ids, 0)
    while engine.has_unfinished():
        prompt_tokens, s = engine.stats.prompt_tokens_computed, time.perf_counter()
        for out in engine.step():
            made[out.request_id] += len(out.new_token_ids)
        decode_only = int(engine.stats.prompt_tokens_computed == prompt_tokens)
        steps[decode_only] += 1
        seconds[decode_only] += time.perf_counter() - s
    wall = time.perf_counter() - t
    assert [made[i] for i in ids] == work.output_lens
    return BatchRun(work.num_output_tokens / wall, steps[0], seconds[0], steps[1], seconds[1])


def tandem_batch(engine, work: Workload) -> float:
    """Output tokens/s of the workload run as one batch (prefill included)."""
    return tandem_batch_run(engine, work).out_tok_s


def tandem_single(engine, prompt: list[int], new: int) -> float:
    """Decode tokens/s of one stream: (new - 1) tokens over the time after the first."""
    return single_stream(engine, prompt, new)[1]


def single_stream(engine, prompt: list[int], new: int) -> tuple[float, float]:
    """(seconds to the first token, decode tokens/s after it) of one stream."""
    from engine import SamplingParams

    t0 = time.perf_counter()
    engine.add_request(prompt, SamplingParams(max_tokens=new, temperature=0, ignore_eos=True))
    first = None
    while engine.has_unfinished():
        engine.step()
        first = first or time.perf_counter()
    return first - t0, (new - 1) / (time.perf_counter() - first)


def hf_batch(model, work: Workload, batch_size: int, pad_id: int) -> float:
    t = time.perf_counter()
    for i in range(0, len(work.prompts), batch_size):
        prompts, lens = work.prompts[i : i + batch_size], work.output_lens[i : i + batch_size]
        width = max(len(p) for p in prompts)
        ids = torch.tensor([[pad_id] * (width - len(p)) + p for p in prompts], device=model.device)
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=model.device)
        new = max(lens)
        with torch.inference_mode():
            model.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=new,
                           min_new_tokens=new, pad_token_id=pad_id)
    return work.num_output_tokens / (time.perf_counter() - t)


def hf_single(model, prompt: list[int], new: int, pad_id: int) -> float:
    ids = torch.tensor([prompt], device=model.device)

    def gen(n: int) -> float:
        with torch.inference_mode():
            return timed(lambda: model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                                max_new_tokens=n, min_new_tokens=n, pad_token_id=pad_id),
                         str(model.device))

    t1, tn = gen(1), gen(new)
    return (new - 1) / (tn - t1)


def weight_bytes(engine) -> int:
    """Weight bytes one decode step reads: every matrix once, quantized ones as packed (scales included); the
    embedding lookup reads a few rows, so a table apart from lm_head does not count."""
    m = engine.runner.model
    tensors = [m.lm_head, m.norm]
    for layer in m.layers:
        tensors += [getattr(layer, n) for n in layer.__slots__ if getattr(layer, n) is not None]
    return sum(t.nbytes for t in tensors)


def bench_dtype(args: argparse.Namespace, dtype: str, work: Workload, single_prompt: list[int]) -> dict:
    from common.engine_args import engine_config
    from engine import Engine
    from tandem.bench.step_profile import gemm_rate_gflops

    args.dtype = dtype
    engine = Engine(engine_config(args))
    engine.generate([single_prompt[:16]] * 2)  # warm-up
    row: dict = {"dtype": dtype, "weight_bytes": weight_bytes(engine),
                 "gemm_gflop_s": gemm_rate_gflops(getattr(torch, dtype), engine.runner.model.kernels, args.device)}
    batch = tandem_batch_run(engine, work)
    row["tandem_batch_out_tok_s"] = batch.out_tok_s
    row["tandem_batch_steps"] = asdict(batch)
    row["tandem_single_decode_tok_s"] = tandem_single(engine, single_prompt, args.single_new_tokens)
    assert engine.num_free_blocks == engine.num_total_blocks
    del engine
    if not args.no_hf:
        row.update(bench_hf(args, dtype, work, single_prompt))
    return row


def bench_hf(args: argparse.Namespace, dtype: str, work: Workload, single_prompt: list[int]) -> dict:

    from common.engine_args import resolve_model

    model = hf_model(resolve_model(args.model), getattr(torch, dtype), args.device, args.load_format)
    pad = model.config.eos_token_id
    pad = pad[0] if isinstance(pad, list) else (pad if pad is not None else 0)
    hf_single(model, single_prompt[:16], 4, pad)  # warm-up
    per_bs = {}
    for bs in [int(b) for b in args.hf_batch_sizes.split(",")]:
        per_bs[bs] = hf_batch(model, work, bs, pad)
        print(f"  transformers {dtype} bs{bs}: {per_bs[bs]:.1f} out tok/s", file=sys.stderr)
    best = max(per_bs, key=per_bs.get)
    return {
        "hf_batch_out_tok_s_by_bs": per_bs,
        "hf_best_bs": best,
        "hf_best_batch_out_tok_s": per_bs[best],
        "hf_single_decode_tok_s": hf_single(model, single_prompt, args.single_new_tokens, pad),
    }


def hf_model(path: Path, dtype: torch.dtype, device: str, load_format: str):
    """transformers' model on the engine's device: the checkpoint, or random weights of its config drawn on
    the device for ``--load-format dummy`` (a config-only folder such as tandem/configs/llama-3-8b)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    if load_format == "dummy":
        with torch.device(device):
            return AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(path), dtype=dtype).eval()
    return AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to(device).eval()


def run(args: argparse.Namespace) -> int:
    from common.engine_args import engine_config, resolve_model
    from engine import ModelConfig
    from engine.kv_blocks import wire_block_bytes
    from tandem.bench.scheduling import SCENARIOS, format_scenarios, run_scenarios
    from tandem.bench.step_profile import format_profile
    from tandem.bench.workload_roofline import workload_roofline

    threads = args.num_threads or torch.get_num_threads()
    args.num_threads = threads
    mc = ModelConfig.from_path(resolve_model(args.model))
    work = make_workload(args.num_requests, _range(args.prompt_len), _range(args.output_len), mc.vocab_size, args.seed)
    single_prompt = make_workload(1, (32, 32), (1, 1), mc.vocab_size, args.seed + 1).prompts[0]
    bw = read_bandwidth_gbps(threads, args.device)
    print(f"read bandwidth {bw:.1f} GB/s ({args.device}, {threads} threads); {args.num_requests} requests, "
          f"{work.num_output_tokens} output tokens", file=sys.stderr)
    names = [n for n in args.scenarios.split(",") if n]
    unknown = set(names) - {"throughput", "step-profile", *SCENARIOS}
    if unknown:
        raise ValueError(f"unknown scenarios {sorted(unknown)}; choose from throughput, step-profile, "
                         f"{', '.join(SCENARIOS)}")
    rows = []
    peer = llama_cpp_workload(args, work, threads) if "throughput" in names else None
    for dtype in args.dtypes.split(",") if "throughput" in names else []:
        row = bench_dtype(args, dtype, work, single_prompt)
        row["roofline_decode_tok_s"] = bw * 1e9 / row["weight_bytes"]
        row["single_fraction_of_roofline"] = row["tandem_single_decode_tok_s"] / row["roofline_decode_tok_s"]
        roof = workload_roofline(mc, [len(p) for p in work.prompts], work.output_lens, row["weight_bytes"],
                                 wire_block_bytes(mc, 1, getattr(torch, dtype).itemsize), bw, row["gemm_gflop_s"],
                                 args.max_num_batched_tokens)
        row["workload_roofline"] = asdict(roof)
        row["batch_fraction_of_roofline"] = row["tandem_batch_out_tok_s"] / roof.out_tok_s
        steps = row["tandem_batch_steps"]
        row["prefill_fraction_of_roofline"] = roof.prefill_s / steps["prefill_steps_s"]
        row["decode_fraction_of_roofline"] = roof.decode_s / steps["decode_steps_s"] if steps["decode_steps"] else None
        if "hf_best_batch_out_tok_s" in row:
            row["batch_ratio_vs_hf"] = row["tandem_batch_out_tok_s"] / row["hf_best_batch_out_tok_s"]
            row["single_ratio_vs_hf"] = row["tandem_single_decode_tok_s"] / row["hf_single_decode_tok_s"]
        if peer is not None:
            row["llama_cpp"] = peer
            row["batch_ratio_vs_llama_cpp"] = row["tandem_batch_out_tok_s"] / peer["out_tok_s"]
        rows.append(row)
        print(f"  done {dtype}: {json.dumps(row)}", file=sys.stderr)
    scenarios = run_scenarios(args, engine_config(args), [n for n in names if n in SCENARIOS])
    if "step-profile" in names:
        scenarios["step-profile"] = run_step_profile(args, bw)
    if rows:
        print(format_table(rows, bw))
    if scenarios:
        print(format_scenarios(scenarios))
    for profile in scenarios.get("step-profile", []):
        print(format_profile(profile))
    write_json(args, rows, bw, scenarios)
    return 0


def llama_cpp_workload(args: argparse.Namespace, work: Workload, threads: int) -> dict | None:
    """llama-cpp-python on the same workload and the model folder's GGUF (its own format: the bundled model's
    4-bit weights), all requests in one continuous batch; None where there is no such Python or GGUF."""
    import tempfile

    from common.engine_args import resolve_model

    gguf = next(iter(sorted(Path(resolve_model(args.model)).glob("*.gguf"))), None)
    if gguf is None or not Path(args.llama_python).is_file():
        print(f"  llama-cpp-python: no GGUF or no {args.llama_python} (build it as ../shared/peers/bench_peers.sh "
              "does, or pass --llama-python): skipped", file=sys.stderr)
        return None
    with tempfile.NamedTemporaryFile("w", suffix=".json") as f:
        json.dump({"prompts": work.prompts, "output_lens": work.output_lens}, f)
        f.flush()
        peer = run_llama_peer(args.llama_python, gguf, threads, "--workload", f.name)
    peer["gguf"] = gguf.name
    print(f"  llama-cpp-python {peer['version']} {gguf.name}: {peer['out_tok_s']:.1f} out tok/s", file=sys.stderr)
    return peer


def run_llama_peer(python: str, gguf: Path, threads: int, *flags: str) -> dict:
    """``llama_cpp_peer.py`` on ``gguf`` in llama-cpp-python's own Python: the JSON object it prints last."""
    import subprocess

    cmd = [python, str(PEER_SCRIPT), "--model", str(gguf), "--threads", str(threads), *flags]
    out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def run_step_profile(args: argparse.Namespace, bw: float) -> list[dict]:
    """The step-profile scenario for each dtype of ``--dtypes``, with this CPU's ISA in the results."""
    from dataclasses import asdict

    from common.engine_args import engine_config
    from engine import Engine, EngineConfig, cpu_ops
    from tandem.bench.step_profile import format_profile, step_profile

    config = engine_config(args)
    base = {k: v for k, v in asdict(config).items() if k != "model_config"}
    isa = [f for f in ("avx2", "avx512f", "avx512_vnni", "avx512_bf16", "amx_bf16", "amx_int8")
           if f in cpu_ops.cpu_flags().split()]
    march = cpu_ops.MARCH
    print(f"step profile on {platform.processor() or platform.machine()}: {' '.join(isa)}; kernels built for {march}",
          file=sys.stderr)
    batches = tuple(int(b) for b in args.profile_batches.split(","))
    results = []
    for dtype in args.dtypes.split(","):
        r = step_profile(lambda **o: Engine(EngineConfig(**{**base, **o})), dtype,
                         config.model_config.vocab_size, args.seed, bw, batches,
                         measure_bw=lambda: read_bandwidth_gbps(torch.get_num_threads(), args.device))
        results.append({**r, "isa": isa, "kernel_march": march})
        print(format_profile(r), file=sys.stderr)
    return results


def _range(text: str) -> tuple[int, int]:
    lo, hi = (int(x) for x in text.split(","))
    return lo, hi


def format_table(rows: list[dict], bw: float) -> str:
    def f(v, fmt="{:.1f}"):
        return "-" if v is None else fmt.format(v)

    gemm = ", ".join(f"{r['dtype']} {r['gemm_gflop_s']:.0f}" for r in rows)
    lines = [
        f"read bandwidth (same run): {bw:.1f} GB/s; GEMM GFLOP/s: {gemm}; workload roofline: prefill at the GEMM "
        "rate, each decode step at max(bytes / bandwidth, FLOPs / GEMM rate)",
        "| dtype | tandem batch out tok/s | workload roofline | fraction | HF best static (bs) | ratio | "
        "llama.cpp (GGUF) | ratio | tandem 1-stream decode tok/s | HF 1-stream | ratio | roofline tok/s | "
        "fraction of roofline |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        hf = f"{f(r.get('hf_best_batch_out_tok_s'))} (bs{r.get('hf_best_bs', '-')})"
        lines.append(
            f"| {r['dtype']} | {f(r['tandem_batch_out_tok_s'])} | {f(r['workload_roofline']['out_tok_s'])} | "
            f"{f(r['batch_fraction_of_roofline'] * 100, '{:.0f}%')} | {hf} | "
            f"{f(r.get('batch_ratio_vs_hf'), '{:.2f}x')} | "
            f"{f(r.get('llama_cpp', {}).get('out_tok_s'))} | {f(r.get('batch_ratio_vs_llama_cpp'), '{:.2f}x')} | "
            f"{f(r['tandem_single_decode_tok_s'])} | {f(r.get('hf_single_decode_tok_s'))} | "
            f"{f(r.get('single_ratio_vs_hf'), '{:.2f}x')} | {f(r['roofline_decode_tok_s'])} | "
            f"{f(r['single_fraction_of_roofline'] * 100, '{:.0f}%')} |"
        )
    return "\n".join(lines + ["", *format_phases(rows)])


def format_phases(rows: list[dict]) -> list[str]:
    """Where the batched run's time went: steps that computed prompt tokens and steps that only decoded, each
    against its part of the workload roofline."""
    lines = ["| dtype | prefill steps | seconds | bound | fraction | decode steps | seconds | bound | fraction |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        steps, roof = r["tandem_batch_steps"], r["workload_roofline"]
        decode = r["decode_fraction_of_roofline"]
        lines.append(
            f"| {r['dtype']} | {steps['prefill_steps']} | {steps['prefill_steps_s']:.2f} | {roof['prefill_s']:.2f} | "
            f"{r['prefill_fraction_of_roofline'] * 100:.0f}% | {steps['decode_steps']} | "
            f"{steps['decode_steps_s']:.2f} | {roof['decode_s']:.2f} | "
            f"{'-' if decode is None else f'{decode * 100:.0f}%'} |"
        )
    return lines


def write_json(args: argparse.Namespace, rows: list[dict], bw: float, scenarios: dict) -> None:
    out = Path(args.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"offline-{time.strftime('%Y%m%d-%H%M%S')}.json"
    settings = {k: v for k, v in vars(args).items() if k != "func"}
    doc = {"bench": "offline", "machine": platform.processor() or platform.machine(), "read_bw_gbps": bw,
           "torch": torch.__version__, "settings": settings, "results": rows,
           "scenarios": scenarios}
    path.write_text(json.dumps(doc, indent=2, default=str))
    print(f"wrote {path}", file=sys.stderr)


