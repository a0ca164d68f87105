"""The ``tandem`` command line."""

from __future__ import annotations

import argparse
import importlib
import sys
from pathlib import Path

from common.engine_args import add_engine_args, engine_flags
from common.settings import env_default
from tandem.client import DEFAULT_GATEWAY

# `tandem serve NAME`: each service module has add_args(parser) and run(args).
SERVICES = {
    "gateway": ("gateway.server", "the public API: validation, routing, orchestration, streaming"),
    "tokenizer": ("tokenizer_svc.server", "the tokenizer service (Tokenize with chat templates, Detokenize)"),
    "prefill": ("prefill_svc.server", "a prefill worker: the engine as producer, pushing KV to the kvstore"),
    "decode": ("decode_svc.server", "a decode worker: the engine as consumer (aggregated without --kvstore)"),
    "kvstore": ("kvstore.server", "a KV block store node (gRPC control plane + UCX data plane)"),
}
# `tandem bench NAME`: each module has add_args(parser) and run(args); the last field: whether it takes the
# engine flags (it runs a model, in-process or in a cluster it starts).
BENCHES = {
    "offline": ("tandem.bench.offline", "engine throughput against transformers, in-process", True),
    "pipeline": ("tandem.bench.pipeline", "the gRPC pipeline against the engine in-process, at low load", True),
    "migration": ("tandem.bench.migration", "the pause a client sees when its decode worker dies: "
                  "recompute against pull", True),
    "kv": ("tandem.bench.kv", "kvstore push/pull against memcpy and gRPC bytes, cross-process", False),
    "serve": ("tandem.bench.serve", "load a running gateway (or an OpenAI-compatible server) at "
              "request rates; latency percentiles, throughput, goodput, plots", False),
    "compare": ("tandem.bench.compare", "aggregated against disaggregated `tandem up`, pinned to cores, "
                "swept over request rates: one table, one plot", True),
    "structured": ("tandem.bench.structured", "structured outputs: per-step overhead of constraints at batch "
                   "1/8/32 against unconstrained, grammar compile times", True),
    "spec": ("tandem.bench.spec", "speculative decoding on against off (n-gram, draft): single-stream decode "
             "and batched throughput on input-grounded and random prompts, acceptance", True),
    "quant": ("tandem.bench.quant", "quantized weights (GGUF-direct, int8) against bfloat16 and llama-cpp-python "
              "on the same GGUF: decode at 32/1024 context, prefill, batched throughput, perplexity", True),
    "tp": ("tandem.bench.tp", "tensor parallelism: per-step communication time and share at TP=1 against TP=2, "
           "and the bytes of a KV block each rank reads", True),
    "front": ("tandem.bench.front", "the OpenAI-compatible HTTP front against gRPC Generate on one `tandem up`, "
              "alternating: TTFT and ITL at one stream, throughput at 32", True),
}


def add_request_args(p: argparse.ArgumentParser) -> None:
    """What one Generate request asks for, shared by ``generate`` and ``up --generate``."""
    g = p.add_argument_group("request")
    g.add_argument("--raw", action="store_true", help="send the prompt as is, without the chat template")
    g.add_argument("--max-tokens", type=int, default=128)
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=-1)
    g.add_argument("--seed", type=int, default=None)
    g.add_argument("--stop", action="append", default=[], metavar="TEXT", help="stop string (repeatable)")
    g.add_argument("--timeout", type=float, default=300.0, help="the call's deadline in seconds")
    g.add_argument("--api-key", default=env_default("--api-key", None, str),
                   help="API key for a gateway that asks for one, sent as `authorization: Bearer` (env TANDEM_API_KEY)")
    s = p.add_argument_group("structured output (one of)").add_mutually_exclusive_group()
    s.add_argument("--json-schema", metavar="FILE|JSON", help="the answer is JSON that validates against this schema")
    s.add_argument("--json-object", action="store_true", help="the answer is a JSON object")
    s.add_argument("--regex", metavar="REGEX", help="the answer matches this regular expression")
    s.add_argument("--choice", action="append", metavar="TEXT", help="the answer is one of these (repeatable)")
    s.add_argument("--grammar", metavar="FILE|TEXT", help="the answer follows this Lark or GBNF grammar")


def add_client_tls_args(p: argparse.ArgumentParser) -> None:
    """How ``tandem generate`` reaches a gateway that serves TLS."""
    g = p.add_argument_group("TLS to the gateway")
    g.add_argument("--tls", action="store_true", default=env_default("--tls", False, bool),
                   help="connect with TLS (implied by --tls-ca; without it the system's trusted roots verify the "
                        "gateway)")
    g.add_argument("--tls-ca", default=env_default("--tls-ca", None, str), metavar="PEM",
                   help="the CA that signed the gateway's certificate (`tandem up --tls` prints it)")
    g.add_argument("--tls-cert", default=env_default("--tls-cert", None, str), metavar="PEM",
                   help="a client certificate, for a gateway that requires one (--tls-client-ca)")
    g.add_argument("--tls-key", default=env_default("--tls-key", None, str), metavar="PEM",
                   help="its private key")
    g.add_argument("--tls-server-name", default=env_default("--tls-server-name", None, str), metavar="NAME",
                   help="the name to verify in the gateway's certificate instead of the address's host")


def client_tls(args: argparse.Namespace):
    """The ``common.tls.ClientTLS`` the flags of ``add_client_tls_args`` ask for; None: plaintext."""
    if not (args.tls or args.tls_ca or args.tls_cert or args.tls_key):
        return None
    from common.tls import ClientTLS

    return ClientTLS.from_files(args.tls_ca, args.tls_cert, args.tls_key, args.tls_server_name)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tandem", description="LLM serving with disaggregated prefill and decode")
    sub = parser.add_subparsers(dest="command", required=True)

    fetch = sub.add_parser("fetch-model", help="fetch and convert the default model into TANDEM_HOME")
    fetch.add_argument("--force", action="store_true", help="convert again even if the model is there")
    fetch.set_defaults(func=_cmd_fetch)

    kernels = sub.add_parser("build-kernels", help="compile the CPU kernels for this machine into TANDEM_HOME")
    kernels.set_defaults(func=_cmd_build_kernels)

    gen = sub.add_parser("generate", help="stream an answer to a prompt")
    gen.add_argument("prompt")
    gen.add_argument("--local", action="store_true", help="run the engine in this process (engine flags apply)")
    gen.add_argument("--gateway", default=env_default("--gateway", DEFAULT_GATEWAY),
                     help=f"the gateway's address (default {DEFAULT_GATEWAY}; env TANDEM_GATEWAY)")
    add_request_args(gen)
    add_client_tls_args(gen)
    add_engine_args(gen)
    gen.set_defaults(func=_cmd_generate)

    up = sub.add_parser("up", help="start the whole pipeline as local processes")
    add_up_args(up)
    add_engine_args(up)
    up.set_defaults(func=_cmd_up)

    trace = sub.add_parser("trace", help="a request's time to first token, hop by hop, from its trace")
    from tandem.trace_view import add_args as add_trace_args

    add_trace_args(trace)
    trace.set_defaults(func=_cmd_trace)

    serve = sub.add_parser("serve", help="run one service in this process")
    serve_sub = serve.add_subparsers(dest="service", required=True)
    for name, (module, help_text) in SERVICES.items():
        svc = serve_sub.add_parser(name, help=help_text)
        importlib.import_module(module).add_args(svc)
        svc.set_defaults(func=_cmd_serve, module=module)

    keys = sub.add_parser("keys", help="API keys of a gateway (--api-keys-file)")
    keys_sub = keys.add_subparsers(dest="keys_command", required=True)
    add_key = keys_sub.add_parser("add", help="make a new API key: prints it once, writes only its hash to the file")
    add_key.add_argument("name", help="the key's name, shown in logs, traces and metrics (A-Z a-z 0-9 . _ -)")
    add_key.add_argument("--api-keys-file", default=env_default("--api-keys-file", None, str),
                         help="the keys file to add the entry to, created if missing (env TANDEM_API_KEYS_FILE)")
    add_key.add_argument("--requests-per-minute", type=float, default=None, help="rate limit (default: none)")
    add_key.add_argument("--max-concurrent-streams", type=int, default=None, help="streams open at once")
    salt = add_key.add_mutually_exclusive_group()
    salt.add_argument("--cache-salt", default=None, help="the tenant's prefix-cache namespace (default: the name); "
                      "keys with the same one share cached blocks")
    salt.add_argument("--share-cache", action="store_true", help="no namespace of its own: share cached blocks "
                      "with every other such key (clients' cache_salt still applies)")
    add_key.set_defaults(func=_cmd_keys_add)

    bench = sub.add_parser("bench", help="benchmarks")
    bench_sub = bench.add_subparsers(dest="bench", required=True)
    for name, (module, help_text, runs_engine) in BENCHES.items():
        b = bench_sub.add_parser(name, help=help_text)
        importlib.import_module(module).add_args(b)
        if runs_engine:
            add_engine_args(b)
        b.set_defaults(func=_cmd_bench)
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


def _cmd_build_kernels(args: argparse.Namespace) -> int:
    from common.paths import kernels_dir
    from engine import cpu_ops

    try:
        cpu_ops.build(kernels_dir())
    except Exception as exc:
        print(f"tandem build-kernels: {exc}\nthe engine will run plain torch ops on CPU (slower decode)",
              file=sys.stderr)
        return 1
    print(cpu_ops.build_dir(kernels_dir()))
    return 0


def add_up_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--mode", default=env_default("--mode", "disaggregated"), choices=["disaggregated", "aggregated"])
    # No TANDEM_* defaults for the counts: the gateway reads those names as address lists.
    p.add_argument("--prefill-workers", type=int, default=1, help="how many (disaggregated mode only)")
    p.add_argument("--decode-workers", type=int, default=1, help="how many")
    p.add_argument("--host", default=env_default("--host", "127.0.0.1"), help="address every service binds")
    p.add_argument("--port", type=int, default=env_default("--port", None, int),
                   help="the gateway's port (default 50051; with --generate a free one; 0: a free one)")
    p.add_argument("--http-port", type=int, default=env_default("--http-port", None, int),
                   help="the gateway's OpenAI-compatible HTTP API (default 8000; with --generate a free one; "
                        "0: a free one; -1: off)")
    p.add_argument("--kv-capacity-gb", type=float, default=env_default("--kv-capacity-gb", 1.0),
                   help="the kvstore's block pool")
    p.add_argument("--redis-url", default=env_default("--redis-url", None, str),
                   help="share the kvstore index through Redis (default: embedded)")
    p.add_argument("--log-dir", type=Path, default=env_default("--log-dir", None, Path),
                   help="where each service's log goes (default: a fresh folder under $TANDEM_HOME/logs)")
    p.add_argument("--startup-timeout", type=float, default=env_default("--startup-timeout", 180.0),
                   help="seconds each start stage may take")
    for kind in ("kvstore", "tokenizer", "prefill", "decode", "gateway"):
        p.add_argument(f"--{kind}-args", default="", metavar="FLAGS",
                       help=f"extra flags for the {kind} service(s), one shell-quoted string")
    p.add_argument("--tls", action="store_true", default=False,
                   help="TLS on the gateway and mutual TLS between the services, with a throwaway CA and "
                        "certificates generated into the log folder (clients: `tandem generate --tls-ca <ca.pem>`)")
    p.add_argument("--generate", metavar="PROMPT", default=None,
                   help="stream one answer through the gateway, then stop everything (exit: the client's code)")
    add_request_args(p)


def _cmd_generate(args: argparse.Namespace) -> int:
    if args.local:
        from tandem.local_generate import generate_local

        return generate_local(args)
    return _generate_remote(args, args.gateway)


def _generate_remote(args: argparse.Namespace, address: str, tls=None) -> int:
    from tandem.client import build_request, generate_to_terminal

    if tls is None and hasattr(args, "tls_ca"):
        tls = client_tls(args)
    from common.pb_convert import structured_to_pb
    from tandem.client import structured_output

    spec = structured_output(args)
    request = build_request(args.prompt, raw=args.raw, max_tokens=args.max_tokens, temperature=args.temperature,
                            top_p=args.top_p, top_k=args.top_k, seed=args.seed, stop=args.stop,
                            structured=structured_to_pb(spec) if spec is not None else None)
    return generate_to_terminal(address, request, args.timeout, tls=tls, api_key=args.api_key)


def _cluster_config(args: argparse.Namespace):
    import shlex

    from tandem.launcher import ClusterConfig

    port = args.port if args.port is not None else (0 if args.generate else 50051)
    http_port = args.http_port if args.http_port is not None else (0 if args.generate else 8000)
    extra = {kind: shlex.split(getattr(args, f"{kind}_args")) for kind in
             ("kvstore", "tokenizer", "prefill", "decode", "gateway")}
    return ClusterConfig(mode=args.mode, num_prefill=args.prefill_workers, num_decode=args.decode_workers,
                         host=args.host, gateway_port=port, http_port=http_port, engine_args=engine_flags(args),
                         kv_capacity_gb=args.kv_capacity_gb, redis_url=args.redis_url,
                         extra_args={k: v for k, v in extra.items() if v}, log_dir=args.log_dir,
                         startup_timeout=args.startup_timeout, tls=args.tls)


def _cmd_up(args: argparse.Namespace) -> int:
    import time

    from tandem.launcher import Cluster, LaunchError, format_table, serve_until_signal

    out = sys.stderr if args.generate else sys.stdout  # with --generate, stdout is the answer alone
    start = time.perf_counter()
    cluster = Cluster(_cluster_config(args))
    print(f"tandem up: starting ({args.mode}), logs in {cluster.log_dir}", file=out, flush=True)
    try:
        cluster.start()
        cluster.wait_healthy(timeout=30)
    except LaunchError as exc:
        cluster.stop()
        print(f"tandem up: {exc}", file=sys.stderr)
        return 1
    with cluster:
        print(format_table(cluster), file=out)
        http = f", OpenAI-compatible API at {cluster.http_url}" if "http" in cluster.gateway.ready else ""
        print(f"ready in {time.perf_counter() - start:.1f} s; gateway at {cluster.gateway.address}{http}", file=out,
              flush=True)
        if cluster.ca_path is not None:
            print(f"TLS: services use mutual TLS, the gateway TLS; its CA is {cluster.ca_path}\n"
                  f'  tandem generate --gateway {cluster.gateway.address} --tls-ca {cluster.ca_path} "..."', file=out,
                  flush=True)
        if args.generate is None:
            return serve_until_signal(cluster, sys.stderr)
        args.prompt = args.generate
        return _generate_remote(args, cluster.gateway.address, cluster.client_tls())


def _cmd_keys_add(args: argparse.Namespace) -> int:
    from gateway.auth import KeysFileError, add_key

    if not args.api_keys_file:
        print("tandem keys add: give --api-keys-file (or TANDEM_API_KEYS_FILE)", file=sys.stderr)
        return 2
    try:
        key = add_key(args.api_keys_file, args.name, args.requests_per_minute, args.max_concurrent_streams,
                      args.cache_salt, args.share_cache)
    except KeysFileError as exc:
        print(f"tandem keys add: {exc}", file=sys.stderr)
        return 1
    print(f"added {args.name!r} to {args.api_keys_file}; the key, shown this once (only its hash is stored):",
          file=sys.stderr)
    print(key)
    return 0


def _cmd_trace(args: argparse.Namespace) -> int:
    from tandem.trace_view import run

    return run(args)


def _cmd_serve(args: argparse.Namespace) -> int:
    return importlib.import_module(args.module).run(args)


def _cmd_bench(args: argparse.Namespace) -> int:
    return importlib.import_module(BENCHES[args.bench][0]).run(args)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except KeyboardInterrupt:
        return 130
    except (ValueError, FileNotFoundError) as exc:
        print(f"tandem {args.command}: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
