"""The ``tandem`` command line."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from tandem.settings import env_default


def add_engine_args(p: argparse.ArgumentParser) -> None:
    """Engine flags shared by every command that runs a model."""
    g = p.add_argument_group("engine")
    g.add_argument("--model", default=env_default("--model", None, str), help="local Hugging Face folder "
                   "(default: the bundled SmolLM2-135M-Instruct; env TANDEM_MODEL)")
    g.add_argument("--dtype", default=env_default("--dtype", "float32"), choices=["float32", "bfloat16", "float16"])
    g.add_argument("--device", default=env_default("--device", "cpu"))
    g.add_argument("--load-format", default=env_default("--load-format", "auto"), choices=["auto", "dummy"])
    g.add_argument("--kv-cache-gb", type=float, default=env_default("--kv-cache-gb", 2.0))
    g.add_argument("--block-size", type=int, default=env_default("--block-size", 16))
    g.add_argument("--max-num-seqs", type=int, default=env_default("--max-num-seqs", 256))
    g.add_argument("--max-num-batched-tokens", type=int, default=env_default("--max-num-batched-tokens", 2048))
    g.add_argument("--max-model-len", type=int, default=env_default("--max-model-len", None, int))
    g.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction,
                   default=env_default("--enable-prefix-caching", True, bool))
    g.add_argument("--enable-chunked-prefill", action=argparse.BooleanOptionalAction,
                   default=env_default("--enable-chunked-prefill", True, bool))
    g.add_argument("--scheduling-policy", default=env_default("--scheduling-policy", "fcfs"),
                   choices=["fcfs", "priority"], help="priority: lower value first, ties by arrival")
    g.add_argument("--attention-backend", default=env_default("--attention-backend", "auto"),
                   choices=["auto", "torch", "sdpa", "flash_attn"])
    g.add_argument("--num-threads", type=int, default=env_default("--num-threads", None, int))


def engine_config(args: argparse.Namespace):
    from engine import EngineConfig

    return EngineConfig(
        model=str(resolve_model(args.model)),
        dtype=args.dtype,
        device=args.device,
        load_format=args.load_format,
        kv_cache_gb=args.kv_cache_gb,
        block_size=args.block_size,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_model_len=args.max_model_len,
        enable_prefix_caching=args.enable_prefix_caching,
        enable_chunked_prefill=args.enable_chunked_prefill,
        scheduling_policy=args.scheduling_policy,
        attention_backend=args.attention_backend,
        num_threads=args.num_threads,
    )


def resolve_model(model: str | None) -> Path:
    if model:
        return Path(model).expanduser()
    from tandem.model_fetch import default_model_dir

    path = default_model_dir()
    if not (path / "config.json").is_file():
        raise SystemExit(f"the default model is not at {path} yet: run `tandem fetch-model` first")
    return path


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tandem", description="LLM serving with disaggregated prefill and decode")
    sub = parser.add_subparsers(dest="command", required=True)

    fetch = sub.add_parser("fetch-model", help="fetch and convert the default model into TANDEM_HOME")
    fetch.add_argument("--force", action="store_true", help="convert again even if the model is there")
    fetch.set_defaults(func=_cmd_fetch)

    gen = sub.add_parser("generate", help="stream an answer to a prompt")
    gen.add_argument("prompt")
    gen.add_argument("--local", action="store_true", help="run the engine in this process")
    gen.add_argument("--raw", action="store_true", help="send the prompt as is, without the chat template")
    gen.add_argument("--max-tokens", type=int, default=128)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--top-k", type=int, default=-1)
    gen.add_argument("--seed", type=int, default=None)
    add_engine_args(gen)
    gen.set_defaults(func=_cmd_generate)

    serve = sub.add_parser("serve", help="run one service in this process")
    serve_sub = serve.add_subparsers(dest="service", required=True)
    kv = serve_sub.add_parser("kvstore", help="a KV block store node (gRPC control plane + UCX data plane)")
    from kvstore.server import add_args as add_kvstore_args

    add_kvstore_args(kv)
    kv.set_defaults(func=_cmd_serve_kvstore)

    bench = sub.add_parser("bench", help="benchmarks")
    bench_sub = bench.add_subparsers(dest="bench", required=True)
    offline = bench_sub.add_parser("offline", help="engine throughput against transformers, in-process")
    from tandem.bench.offline import add_args as add_offline_args

    add_offline_args(offline)
    add_engine_args(offline)
    offline.set_defaults(func=_cmd_bench_offline)
    kv_bench = bench_sub.add_parser("kv", help="kvstore push/pull against memcpy and gRPC bytes, cross-process")
    from tandem.bench.kv import add_args as add_kv_args

    add_kv_args(kv_bench)
    kv_bench.set_defaults(func=_cmd_bench_kv)
    return parser


def _cmd_fetch(args: argparse.Namespace) -> int:
    from tandem.model_fetch import ModelFetchError, fetch_default_model

    try:
        path = fetch_default_model(force=args.force)
    except ModelFetchError as exc:
        print(f"tandem fetch-model: {exc}", file=sys.stderr)
        return 1
    print(path)
    return 0


def _cmd_generate(args: argparse.Namespace) -> int:
    if not args.local:
        print("tandem generate: the gRPC pipeline is not built yet; use --local to run the engine in-process",
              file=sys.stderr)
        return 2
    from tandem.local_generate import generate_local

    return generate_local(args)


def _cmd_serve_kvstore(args: argparse.Namespace) -> int:
    from kvstore.server import run

    return run(args)


def _cmd_bench_kv(args: argparse.Namespace) -> int:
    from tandem.bench.kv import run

    return run(args)


def _cmd_bench_offline(args: argparse.Namespace) -> int:
    from tandem.bench.offline import run

    return run(args)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except (ValueError, FileNotFoundError) as exc:
        print(f"tandem {args.command}: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
