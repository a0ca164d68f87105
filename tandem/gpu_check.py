"""`make gpu-check` / `python -m tandem.gpu_check`: what a GPU machine says about tandem's GPU path, in
one run of a few minutes, as JSON lines (one per check, ``{"check": ..., "ok": ..., ...}``).

Checks: the device (probe); HBM read bandwidth; pinned PCIe copies both ways; greedy parity with
transformers on the device (tiny random Llama, Qwen2 and Mistral: float32 token for token, bfloat16 and
float16 drift reported); attention backends agreeing; a KV handoff producer -> consumer on the device, and
from a CPU producer to a device consumer; KV export + import GB/s at Llama-3-8B geometry against pinned
PCIe; single-stream decode of a dummy Llama-3-8B in bfloat16 as a share of HBM bandwidth; and a
disaggregated `tandem up` on one GPU answering. Targets from issue 23 ride along in each line.

Every check runs on its own: one that fails (or does not apply: no GPU, no flash-attn) says why and the
others go on. ``--device cpu --quick`` runs the same code on a CPU at toy sizes: the test suite does, so
the script stays runnable where no GPU is.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path

import torch

from tandem.bench.timing import best_of

LLAMA_3_8B = Path(__file__).parent / "configs" / "llama-3-8b"
TINY_VOCAB = 256


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda")
    p.add_argument("--quick", action="store_true", help="toy sizes (a CPU dry run of the script itself)")
    p.add_argument("--skip", default="", help="comma-separated checks to leave out")
    p.add_argument("--out", default=None, help="also append the JSON lines to this file")
    args = p.parse_args(argv)
    failed = 0
    work = Path(tempfile.mkdtemp(prefix="tandem-gpu-check-"))
    for name, check in CHECKS.items():
        if name in args.skip.split(","):
            continue
        line = run_check(name, check, args, work)
        failed += line["ok"] is False
        text = json.dumps(line, default=str)
        print(text, flush=True)
        if args.out:
            with open(args.out, "a") as f:
                f.write(text + "\n")
    return 1 if failed else 0


def run_check(name: str, check: Callable, args: argparse.Namespace, work: Path) -> dict:
    start = time.perf_counter()
    try:
        result = check(torch.device(args.device), args.quick, work)
    except Skip as why:
        result = {"ok": None, "skipped": str(why)}
    except Exception as exc:  # one check's failure is its line, not the end of the run
        result = {"ok": False, "error": repr(exc), "trace": traceback.format_exc(limit=4)}
    return {"check": name, **result, "seconds": round(time.perf_counter() - start, 2)}


class Skip(Exception):
    """The check does not apply here (no GPU, a missing package): reported, not a failure."""


def _cuda_only(device: torch.device) -> None:
    if device.type != "cuda":
        raise Skip("needs --device cuda")


# ---- the checks ----------------------------------------------------------------------------------------------


def probe(device: torch.device, quick: bool, work: Path) -> dict:
    from engine.attention import flash_attn_available

    out = {"ok": True, "torch": torch.__version__, "cuda_available": torch.cuda.is_available(),
           "flash_attn": flash_attn_available(), **_versions("triton", "transformers", "flash_attn_interface",
                                                              "flashinfer", "ucxx", "grpc")}
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        out.update(name=props.name, capability=f"{props.major}.{props.minor}",
                   memory_gib=round(props.total_memory / 2**30, 1), cuda=torch.version.cuda,
                   nccl=torch.distributed.is_nccl_available())
        out["ok"] = torch.cuda.is_available()
    return out


def _versions(*modules: str) -> dict:
    """Each module's version, or None where it is not installed."""
    import importlib

    out = {}
    for name in modules:
        try:
            out[name] = getattr(importlib.import_module(name), "__version__", "present")
        except Exception:  # missing, or broken on this machine: either way not usable
            out[name] = None
    return out


def hbm_bandwidth(device: torch.device, quick: bool, work: Path) -> dict:
    x = torch.ones((1 << 24) if quick else (1 << 30), dtype=torch.float32, device=device)  # 64 MiB or 4 GiB
    seconds = best_of(3, x.sum, str(device))
    return {"ok": True, "read_gbps": round(x.nbytes / seconds / 1e9, 1), "bytes": x.nbytes}


def pcie(device: torch.device, quick: bool, work: Path) -> dict:
    _cuda_only(device)
    n = 1 << 28  # 256 MiB
    host = torch.empty(n, dtype=torch.uint8, pin_memory=True)
    dev = torch.empty(n, dtype=torch.uint8, device=device)
    h2d = best_of(3, lambda: dev.copy_(host, non_blocking=True), str(device))
    d2h = best_of(3, lambda: host.copy_(dev, non_blocking=True), str(device))
    return {"ok": True, "h2d_gbps": round(n / h2d / 1e9, 1), "d2h_gbps": round(n / d2h / 1e9, 1)}


def parity(device: torch.device, quick: bool, work: Path) -> dict:
    """tandem's greedy tokens against transformers' on the same device and checkpoint."""
    from transformers import AutoModelForCausalLM

    prompts = [[3, 17, 99, 42, 7], list(range(10, 60))]
    n = 8 if quick else 24
    results, ok = {}, True
    dtypes = ["float32"] + ([] if quick else ["bfloat16"] + (["float16"] if device.type == "cuda" else []))
    for model_type in ("llama", "qwen2", "mistral"):
        path = tiny_checkpoint(work / model_type, model_type)
        for dtype in dtypes:
            hf = AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, dtype)).to(device).eval()
            want = [hf_greedy(hf, p, n) for p in prompts]
            got = _engine(path, device, dtype).generate(prompts, _greedy(n))
            first = [_first_difference(a, b) for a, b in zip(got, want, strict=True)]
            results[f"{model_type}/{dtype}"] = first
            ok &= dtype != "float32" or all(f is None for f in first)  # float32: token for token
    return {"ok": ok, "first_difference_by_prompt": results, "target": "float32 equal; half precision: drift"}


def backends(device: torch.device, quick: bool, work: Path) -> dict:
    """Every backend that can run here gives the torch backend's greedy tokens: in float32 token for token
    (the check's verdict), in bfloat16 on a GPU the first difference is reported (summation orders differ).
    The Triton backend runs with CUDA graphs (the default) and eagerly."""
    from engine.attention import backend_choice, flash_attn_available, triton_available

    path = tiny_checkpoint(work / "llama-backends", "llama", head_dim=64, num_attention_heads=2, hidden_size=128)
    prompts = [list(range(5, 40)), [9, 8, 7]]
    has_triton = device.type == "cuda" and triton_available()
    references: dict[tuple[str, int], list[list[int]]] = {}
    out, ok = {}, True
    for dtype in ["float32"] + (["bfloat16"] if device.type == "cuda" else []):
        for name, extra in (("sdpa", {}), ("triton", {}), ("triton", {"cuda_graphs": False}), ("flash_attn", {}),
                            ("cpu", {})):
            label = f"{name}{' eager' if extra else ''}/{dtype}"
            block = 256 if name == "flash_attn" else 16
            try:
                backend_choice(name, device.type, getattr(torch, dtype), block, 64, device.type == "cpu",
                               flash_attn_available(), has_triton)
            except ValueError as why:
                out[label] = f"not here: {why}"
                continue
            if (dtype, block) not in references:
                references[dtype, block] = _engine(path, device, dtype, attention_backend="torch",
                                                   block_size=block).generate(prompts, _greedy(12))
            want = references[dtype, block]
            got = _engine(path, device, dtype, attention_backend=name, block_size=block, **extra).generate(
                prompts, _greedy(12))
            diffs = [_first_difference(a, b) for a, b in zip(got, want, strict=True)]
            out[label] = "agrees" if got == want else f"differs at {diffs}"
            ok &= got == want or dtype != "float32"
    return {"ok": ok, "against_torch": out, "target": "float32 equal; bfloat16: drift"}


def kv_handoff(device: torch.device, quick: bool, work: Path) -> dict:
    """A producer's blocks continue in a consumer: on the device, and from a CPU producer to it."""
    from engine import RequestOptions
    from engine.kv_transfer import LocalKVTransfer

    path = tiny_checkpoint(work / "llama-handoff", "llama")
    prompts = [list(range(1, 50)), [4, 5, 6, 7, 8, 9, 10]]
    want = _engine(path, device, "float32").generate(prompts, _greedy(10))
    out = {}
    for producer_device in (device, torch.device("cpu")):
        store = LocalKVTransfer()
        # a CPU producer without the compiled CPU kernels: the CPU suite checks those, and building them
        # here would spend the GPU machine's minutes on a compiler
        producer = _engine(path, producer_device, "float32", connector=store, role="producer",
                           cpu_kernels=producer_device.type != "cpu" or device.type == "cpu")
        firsts = producer.generate(prompts, _greedy(10))
        consumer = _engine(path, device, "float32", connector=store, role="consumer")
        options = [RequestOptions(output_token_ids=f, num_external_tokens=len(p))
                   for p, f in zip(prompts, firsts, strict=True)]
        rest = consumer.generate(prompts, _greedy(10), options)
        got = [f + r for f, r in zip(firsts, rest, strict=True)]
        out[f"{producer_device.type}->{device.type}"] = got == want and consumer.stats.kv_load_failures == 0
    return {"ok": all(out.values()), "equal_to_aggregated": out}


def kv_export_import(device: torch.device, quick: bool, work: Path) -> dict:
    """Export + import of 128 MiB of KV at Llama-3-8B geometry through the engine's staging pool."""
    import math

    from engine.kv_blocks import wire_block_shape

    engine = _engine(_geometry(work, quick), device, "bfloat16" if device.type == "cuda" else "float32",
                     load_format="dummy", num_kv_blocks=256 if quick else 128, kv_staging_mb=256, max_model_len=512,
                     connector=_null_connector())
    shape = wire_block_shape(engine.model_config, engine.config.block_size)
    block_bytes = math.prod(shape) * torch.empty((), dtype=engine.config.torch_dtype).element_size()
    n = max(1, (128 << 20) // block_bytes) if not quick else 8
    staged = engine.staging.take(n)
    ids = list(range(n))
    export = best_of(3, lambda: engine.runner.export_blocks(ids, staged.tensor), str(device))
    import_ = best_of(3, lambda: engine.runner.import_blocks(ids, staged.tensor), str(device))
    staged.release()
    nbytes = n * block_bytes
    return {"ok": True, "bytes": nbytes, "export_gbps": round(nbytes / export / 1e9, 2),
            "import_gbps": round(nbytes / import_ / 1e9, 2),
            "target": ">= 50% of pinned PCIe (the pcie line) each way"}


def decode_hbm(device: torch.device, quick: bool, work: Path) -> dict:
    """Single-stream decode of dummy Llama-3-8B weights (bfloat16): weight bytes per token x tokens/s,
    as a share of the HBM read bandwidth; with CUDA graphs (the verdict) and eagerly, and 64 streams batched."""
    from tandem.bench.offline import Workload, read_bandwidth_gbps, single_stream, tandem_batch, weight_bytes

    dtype = "bfloat16" if device.type == "cuda" else "float32"
    prompt = list(range(1000, 1032))

    def engine_and_tok_s(graphs: bool):
        engine = _engine(_geometry(work, quick), device, dtype, load_format="dummy", kv_cache_gb=1.0,
                         max_model_len=2048, cuda_graphs=graphs)
        single_stream(engine, prompt, 4)  # warm-up (and the batch-of-one graph's capture)
        return engine, single_stream(engine, prompt, 16 if quick else 64)[1]

    engine, tok_s = engine_and_tok_s(True)  # CUDA graphs, the default on CUDA
    streams = 4 if quick else 64
    batch = Workload([list(range(2000 + i, 2032 + i)) for i in range(streams)], [64] * streams)
    tandem_batch(engine, Workload(batch.prompts, [2] * streams))  # captures the graphs of this batch size
    graphs = engine.runner.graphs
    used = {"attention_backend": engine.runner.attn.name, "cuda_graphs": graphs is not None and bool(graphs.graphs),
            "batch64_output_tok_s": round(tandem_batch(engine, batch), 1)}  # prefill included
    weights = weight_bytes(engine)
    del engine
    if device.type == "cuda":
        torch.cuda.empty_cache()
    eager_tok_s = engine_and_tok_s(False)[1]
    # the larger of two reads: the benches' 1 GiB torch.sum, and 4 GiB (as hbm_bandwidth), which pays its
    # launch and synchronisation over more bytes and reads ~20% more on an H200
    bw = max(read_bandwidth_gbps(torch.get_num_threads(), str(device)), hbm_bandwidth(device, quick, work)["read_gbps"])
    share = weights * tok_s / (bw * 1e9)
    return {"ok": True if quick else share >= 0.7, "decode_tok_s": round(tok_s, 1),
            "eager_decode_tok_s": round(eager_tok_s, 1), **used, "hbm_read_gbps": round(bw, 1),
            "weight_gb": round(weights / 1e9, 2), "share_of_bandwidth": round(share, 3), "target": ">= 0.70"}


def tandem_up(device: torch.device, quick: bool, work: Path) -> dict:
    """A disaggregated `tandem up` on this device answers a request through the gateway, with the tokens
    of the same engine in this process: the KV went prefill -> store -> decode (into the decode worker's
    staging rows, then onto the device) intact."""
    from tandem.launcher import ClusterConfig

    path = tiny_checkpoint(work / "llama-up", "llama", tokenizer=True)
    config = ClusterConfig(mode="disaggregated", engine_args=["--model", str(path), "--device", str(device),
                                                              "--dtype", "float32", "--kv-cache-gb", "0.25"],
                           kv_capacity_gb=0.25, log_dir=work / "logs", startup_timeout=150,
                           gateway_port=0)  # a free port: the machine may already serve on 50051
    want = _engine(path, device, "float32").generate([PROMPT_UP], _greedy(8))[0]
    try:
        tokens = _ask_cluster(config)
    except Exception as exc:  # the services' last words say why, where the exception alone would not
        raise RuntimeError(f"{exc!r}; {_log_tails(config.log_dir)}") from exc
    return {"ok": tokens == want, "tokens": tokens, "in_process": want}


PROMPT_UP = list(range(3, 20))


def _ask_cluster(config) -> list[int]:
    import asyncio

    from protos import common_pb2, gateway_pb2
    from tandem.client import stream_generate
    from tandem.launcher import Cluster

    with Cluster(config) as cluster:
        cluster.wait_healthy(60)

        async def ask() -> list[int]:
            request = gateway_pb2.GenerateRequest(
                token_ids=gateway_pb2.TokenIds(ids=PROMPT_UP),
                sampling=common_pb2.SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))
            return [t async for m in stream_generate(cluster.gateway.address, request, timeout=120)
                    for t in m.token_ids]

        return asyncio.run(ask())


def _log_tails(log_dir: Path, lines: int = 6) -> dict[str, str]:
    return {f.name: "\n".join(f.read_text(errors="replace").splitlines()[-lines:])
            for f in sorted(Path(log_dir).glob("*")) if f.is_file()}


CHECKS: dict[str, Callable[[torch.device, bool, Path], dict]] = {
    "probe": probe, "hbm_bandwidth": hbm_bandwidth, "pcie": pcie, "parity": parity, "backends": backends,
    "kv_handoff": kv_handoff, "kv_export_import": kv_export_import, "decode_hbm": decode_hbm, "tandem_up": tandem_up,
}


# ---- helpers ------------------------------------------------------------------------------------------------


def tiny_checkpoint(path: Path, model_type: str, tokenizer: bool = False, **overrides) -> Path:
    """A tiny random checkpoint saved by transformers (and a word-level tokenizer of its vocabulary)."""
    import transformers

    if (path / "config.json").exists():
        return path
    cls = {"llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
           "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
           "mistral": (transformers.MistralConfig, transformers.MistralForCausalLM)}[model_type]
    kwargs = dict(vocab_size=TINY_VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512, initializer_range=0.2,
                  eos_token_id=None, bos_token_id=None, tie_word_embeddings=False)
    if model_type == "mistral":
        kwargs["sliding_window"] = None
    kwargs.update(overrides)
    torch.manual_seed(0)
    cls[1](cls[0](**kwargs)).eval().save_pretrained(path)
    if tokenizer:
        _word_tokenizer(path)
    return path


def _word_tokenizer(path: Path) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {f"w{i}": i for i in range(TINY_VOCAB)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "PreTrainedTokenizerFast"}))


def _geometry(work: Path, quick: bool) -> Path:
    """Llama-3-8B's config, or at toy size for --quick (same code path, a CPU's worth of weights)."""
    if not quick:
        return LLAMA_3_8B
    path = work / "llama-3-8b-toy"
    path.mkdir(exist_ok=True)
    cfg = json.loads((LLAMA_3_8B / "config.json").read_text())
    cfg.update(hidden_size=256, intermediate_size=512, num_hidden_layers=4, num_attention_heads=8,
               num_key_value_heads=2, vocab_size=4096)
    (path / "config.json").write_text(json.dumps(cfg))
    return path


def _engine(path: Path, device: torch.device, dtype: str, connector=None, **kwargs):
    from engine import Engine

    kwargs.setdefault("num_kv_blocks", 64)
    return Engine.from_model(str(path), connector, device=str(device), dtype=dtype, **kwargs)


def _null_connector():
    """A connector, so the engine keeps a staging pool (nothing is saved or loaded through it)."""
    from engine.kv_transfer import LocalKVTransfer

    return LocalKVTransfer()


def _greedy(n: int):
    from engine import SamplingParams

    return SamplingParams(max_tokens=n, temperature=0, ignore_eos=True)


def hf_greedy(model, prompt: list[int], n: int) -> list[int]:
    ids = torch.tensor([prompt], device=model.device)
    with torch.inference_mode():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=n,
                             min_new_tokens=n, pad_token_id=0)
    return out[0, len(prompt):].tolist()


def _first_difference(a: list[int], b: list[int]) -> int | None:
    """The first position where two token lists differ (None: equal)."""
    for i, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


if __name__ == "__main__":
    sys.exit(main())
