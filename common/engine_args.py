"""The engine's flags, shared by every process that runs a model (workers, `tandem up`, `tandem
generate --local`, the benchmarks), and the one place they become an ``EngineConfig``.

Every flag is also a ``TANDEM_*`` variable (``common.settings``), so the Helm chart and `tandem up`
configure workers the same way. Nothing here imports torch: `tandem --help` stays fast.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import TYPE_CHECKING

from common.paths import default_model_dir, kernels_dir
from common.settings import env_default

if TYPE_CHECKING:
    from engine import EngineConfig


def add_engine_args(p: argparse.ArgumentParser) -> None:
    """Engine flags shared by every command that runs a model."""
    g = p.add_argument_group("engine")
    g.add_argument("--model", default=env_default("--model", None, str), help="local Hugging Face folder, or a "
                   ".gguf file beside its config.json and tokenizer (default: the bundled SmolLM2-135M-Instruct; "
                   "env TANDEM_MODEL)")
    g.add_argument("--quantization", default=env_default("--quantization", "auto"),
                   choices=["auto", "none", "int8", "gguf", "fp8"],
                   help="weights: none (the checkpoint's floats), int8 (per channel, quantized at load), gguf (the "
                   "folder's .gguf file, its Q4_0/Q4_1/Q8_0 tensors as they are), fp8 (e4m3 per channel, CUDA GPUs "
                   "with FP8 tensor cores); auto: what the model is")
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
                   choices=["auto", "cpu", "torch", "sdpa", "triton", "flash_attn"],
                   help="auto: the compiled kernel on CPU; on CUDA flash-attn where its 256-token pages fit, else "
                        "the Triton paged kernel")
    g.add_argument("--cuda-graphs", action=argparse.BooleanOptionalAction,
                   default=env_default("--cuda-graphs", True, bool),
                   help="on CUDA, replay decode steps as CUDA graphs (with the triton attention backend)")
    g.add_argument("--cpu-kernels", action=argparse.BooleanOptionalAction,
                   default=env_default("--cpu-kernels", True, bool),
                   help="on CPU, the compiled kernels (built once into $TANDEM_HOME/kernels); off: plain torch ops")
    g.add_argument("--num-threads", type=int, default=env_default("--num-threads", None, int),
                   help="torch threads of each process (of each rank, with tensor parallelism)")
    g.add_argument("--tensor-parallel-size", "-tp", type=int, default=env_default("--tensor-parallel-size", 1),
                   help="ranks this worker splits the model over (one process each; gloo on CPU, NCCL on CUDA, "
                        "where each rank needs a GPU of its own): heads and MLP width must divide evenly, KV heads "
                        "divide or are replicated")
    g.add_argument("--grammar-compile-timeout-s", type=float, default=env_default("--grammar-compile-timeout-s", 10.0),
                   help="structured outputs: a constraint that takes longer to compile is refused (INVALID_ARGUMENT)")
    g.add_argument("--grammar-cache-size", type=int, default=env_default("--grammar-cache-size", 256),
                   help="structured outputs: compiled constraints kept for reuse (by their text)")
    add_speculative_args(p)


def add_speculative_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("speculative decoding (decode steps)")
    g.add_argument("--speculative-method", default=env_default("--speculative-method", "none"),
                   choices=["none", "ngram", "draft"],
                   help="ngram: prompt lookup (no extra model); draft: --speculative-model proposes")
    g.add_argument("--num-speculative-tokens", type=int, default=env_default("--num-speculative-tokens", 4),
                   help="tokens proposed per step")
    g.add_argument("--speculative-model", default=env_default("--speculative-model", None, str),
                   help="draft: a smaller model's folder, of the same tokenizer")
    g.add_argument("--prompt-lookup-min", type=int, default=env_default("--prompt-lookup-min", 2),
                   help="ngram: the shortest suffix looked up")
    g.add_argument("--prompt-lookup-max", type=int, default=env_default("--prompt-lookup-max", 5),
                   help="ngram: the longest suffix looked up")
    g.add_argument("--speculative-max-batch", type=int, default=env_default("--speculative-max-batch", 16),
                   help="no speculation while more decodes than this run (a large batch is bound by compute)")
    g.add_argument("--speculative-min-acceptance", type=float,
                   default=env_default("--speculative-min-acceptance", 0.2),
                   help="a request whose proposals are accepted less often pauses speculating, longer each time")


def engine_flags(args: argparse.Namespace) -> list[str]:
    """The engine flags the user set (values that differ from their defaults), as flags again: what
    ``tandem up`` hands to its workers, which read the same defaults and TANDEM_* variables themselves."""
    parser = argparse.ArgumentParser(add_help=False)
    add_engine_args(parser)
    flags: list[str] = []
    for action in parser._actions:
        value = getattr(args, action.dest, action.default)
        if not action.option_strings or value == action.default:
            continue
        flag = action.option_strings[0]
        if isinstance(action, argparse.BooleanOptionalAction):
            flags.append(flag if value else "--no-" + flag[2:])
        else:
            flags += [flag, str(value)]
    return flags


def engine_config(args: argparse.Namespace) -> EngineConfig:
    """The ``EngineConfig`` the flags ask for. Raises ValueError (no default model yet, bad values)."""
    from engine import EngineConfig

    return EngineConfig(
        model=str(resolve_model(args.model)),
        dtype=args.dtype,
        device=args.device,
        load_format=args.load_format,
        quantization=args.quantization,
        kv_cache_gb=args.kv_cache_gb,
        block_size=args.block_size,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_model_len=args.max_model_len,
        enable_prefix_caching=args.enable_prefix_caching,
        enable_chunked_prefill=args.enable_chunked_prefill,
        scheduling_policy=args.scheduling_policy,
        attention_backend=args.attention_backend,
        cpu_kernels=args.cpu_kernels,
        cuda_graphs=args.cuda_graphs,
        kernel_cache_dir=str(kernels_dir()),
        num_threads=args.num_threads,
        tensor_parallel_size=args.tensor_parallel_size,
        grammar_compile_timeout_s=args.grammar_compile_timeout_s,
        grammar_cache_size=args.grammar_cache_size,
        speculative_method=args.speculative_method,
        num_speculative_tokens=args.num_speculative_tokens,
        speculative_model=str(Path(args.speculative_model).expanduser()) if args.speculative_model else None,
        prompt_lookup_min=args.prompt_lookup_min,
        prompt_lookup_max=args.prompt_lookup_max,
        speculative_max_batch=args.speculative_max_batch,
        speculative_min_acceptance=args.speculative_min_acceptance,
    )


def resolve_model(model: str | None) -> Path:
    """``model``'s folder, or the default model's once `tandem fetch-model` has converted it.

    Raises ValueError rather than exiting: a service reports it at start like any bad flag.
    """
    if model:
        return Path(model).expanduser()
    path = default_model_dir()
    if not (path / "config.json").is_file():
        raise ValueError(f"the default model is not at {path} yet: run `tandem fetch-model` first")
    return path
