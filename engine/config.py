"""Configuration objects of the engine: what the model is, and how the engine runs it.

Both validate in ``__post_init__`` so that a bad setting fails when the engine is
built, with a message a person can act on, rather than deep inside a step.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2")
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")
SCHEDULING_POLICIES = ("fcfs", "priority")
ROLES = ("both", "producer", "consumer")
SPECULATIVE_METHODS = ("none", "ngram", "draft")
QUANTIZATIONS = ("auto", "none", "int8", "gguf", "fp8")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class UnsupportedModelError(ValueError):
    """The checkpoint exists but describes a model this engine cannot run."""


@dataclass(slots=True, frozen=True)
class ModelConfig:
    """The shape of a Llama-family decoder, read from a Hugging Face ``config.json``."""

    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool
    rope_scaling: dict[str, Any] | None = None
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if self.model_type not in SUPPORTED_MODEL_TYPES:
            raise UnsupportedModelError(
                f"model_type {self.model_type!r} is not supported; tandem runs {', '.join(SUPPORTED_MODEL_TYPES)}"
            )
        if self.num_heads % self.num_kv_heads:
            raise UnsupportedModelError(
                f"num_attention_heads ({self.num_heads}) must be a multiple of num_key_value_heads "
                f"({self.num_kv_heads})"
            )
        rope_type = (self.rope_scaling or {}).get("rope_type", (self.rope_scaling or {}).get("type", "default"))
        if rope_type not in SUPPORTED_ROPE_TYPES:
            raise UnsupportedModelError(f"rope_scaling type {rope_type!r} is not supported")

    @classmethod
    def from_dict(cls, cfg: dict[str, Any]) -> ModelConfig:
        """Read the fields tandem needs; reject features that would silently change the output."""
        model_type = cfg.get("model_type", "")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise UnsupportedModelError(
                f"model_type {model_type!r} is not supported; tandem runs {', '.join(SUPPORTED_MODEL_TYPES)}"
            )
        try:
            return cls._from_dict(cfg, model_type)
        except KeyError as exc:
            raise UnsupportedModelError(f"config.json lacks the field {exc.args[0]!r}") from exc

    @classmethod
    def _from_dict(cls, cfg: dict[str, Any], model_type: str) -> ModelConfig:
        num_heads = cfg["num_attention_heads"]
        if model_type == "mistral" and cfg.get("sliding_window") not in (None, 0):
            if cfg["sliding_window"] < cfg.get("max_position_embeddings", 0):
                raise UnsupportedModelError("sliding-window attention is not supported yet")
        if model_type == "qwen2" and cfg.get("use_sliding_window"):
            raise UnsupportedModelError("sliding-window attention is not supported yet")
        if cfg.get("hidden_act", "silu") != "silu":
            raise UnsupportedModelError(f"hidden_act {cfg.get('hidden_act')!r} is not supported")
        eos = cfg.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,))
        return cls(
            model_type=model_type,
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"],
            num_layers=cfg["num_hidden_layers"],
            num_heads=num_heads,
            num_kv_heads=cfg.get("num_key_value_heads") or num_heads,
            head_dim=cfg.get("head_dim") or cfg["hidden_size"] // num_heads,
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
            rope_theta=_rope_theta(cfg),
            max_position_embeddings=cfg.get("max_position_embeddings", 2048),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            qkv_bias=model_type == "qwen2" or bool(cfg.get("attention_bias", False)),
            rope_scaling=_rope_scaling(cfg),
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=eos_ids,
        )

    @classmethod
    def from_path(cls, model_dir: str | Path) -> ModelConfig:
        path = Path(model_dir)
        cfg_file = path / "config.json"
        if not cfg_file.is_file():
            raise FileNotFoundError(
                f"no model at {path}: expected a Hugging Face folder with config.json "
                "(run `tandem fetch-model` for the default model)"
            )
        return cls.from_dict(json.loads(cfg_file.read_text()))

    def to_dict(self) -> dict[str, Any]:
        return {name: getattr(self, name) for name in self.__dataclass_fields__}


def _rope_theta(cfg: dict[str, Any]) -> float:
    params = cfg.get("rope_parameters") or {}
    return float(cfg.get("rope_theta") or params.get("rope_theta") or 10000.0)


def _rope_scaling(cfg: dict[str, Any]) -> dict[str, Any] | None:
    """transformers 5 moved rope settings into ``rope_parameters``; accept both spellings."""
    scaling = cfg.get("rope_scaling") or cfg.get("rope_parameters")
    if not scaling:
        return None
    scaling = dict(scaling)
    scaling.pop("rope_theta", None)
    if scaling.get("rope_type", scaling.get("type", "default")) == "default":
        return None
    return scaling


@dataclass(slots=True)
class EngineConfig:
    """How one engine runs a model: memory, batching limits, dtype and device."""

    model: str  # a Hugging Face folder, or a .gguf file whose folder holds config.json and the tokenizer
    dtype: str = "float32"
    device: str = "cpu"
    load_format: str = "auto"  # "auto" (safetensors) or "dummy" (random weights from config.json)
    block_size: int = 16
    kv_cache_gb: float = 2.0
    num_kv_blocks: int | None = None  # overrides kv_cache_gb when set
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    max_model_len: int | None = None
    enable_chunked_prefill: bool = True
    enable_prefix_caching: bool = True
    scheduling_policy: str = "fcfs"  # "fcfs" or "priority" (lower value first, ties by arrival)
    role: str = "both"  # "both" (aggregated), "producer" (prefill only) or "consumer" (decode only)
    # Consumer role: push full blocks of generated tokens to the connector as they fill, so that a
    # request moved to another worker pulls its KV instead of recomputing it.
    push_generated_blocks: bool = False
    attention_backend: str = "auto"  # engine.attention.BACKENDS
    cuda_graphs: bool = True  # on CUDA, decode steps replayed as CUDA graphs (engine.cuda_graphs)
    cpu_kernels: bool = True  # on CPU, the compiled kernels of engine/csrc when they build here
    kernel_cache_dir: str | None = None  # where they are built and cached (None: ~/.cache/tandem/kernels)
    num_threads: int | None = None
    seed: int = 0
    # Structured outputs: how long one grammar may take to compile, and how many compiled ones are kept.
    grammar_compile_timeout_s: float = 10.0
    grammar_cache_size: int = 256
    # Speculative decoding of decode steps: "none", "ngram" (prompt lookup) or "draft" (speculative_model, a
    # smaller model of the same tokenizer); up to num_speculative_tokens per step; nobody speculates while more
    # than speculative_max_batch decodes run, and a request whose guesses are accepted less often than
    # speculative_min_acceptance pauses.
    speculative_method: str = "none"
    num_speculative_tokens: int = 4
    prompt_lookup_min: int = 2
    prompt_lookup_max: int = 5
    speculative_model: str | None = None
    speculative_max_batch: int = 16
    speculative_min_acceptance: float = 0.2
    # Weights: "none" (the checkpoint's floats in dtype), "int8" (per-channel, quantized at load), "gguf" (the
    # GGUF file's quantized tensors as they are), "fp8" (e4m3 per channel, CUDA GPUs with FP8 tensor cores);
    # "auto": gguf when model is a .gguf file or a folder holding only a GGUF, else none. gguf_file is resolved
    # from model.
    quantization: str = "auto"
    gguf_file: str | None = None
    # Host memory (MiB) that KV exports and pulls borrow instead of allocating (engine.kv_staging); pinned on
    # CUDA. A transfer larger than what is free allocates as before.
    kv_staging_mb: int = 256
    # Ranks one worker splits the model over (engine.parallel): rank 0 runs the engine, the others follow.
    tensor_parallel_size: int = 1
    model_config: ModelConfig | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        self._resolve_weights()
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, got {self.dtype!r}")
        if self.dtype == "float16" and not self.device.startswith("cuda"):
            raise ValueError("float16 is supported on CUDA only; use float32 or bfloat16 on CPU")
        if self.load_format not in ("auto", "dummy"):
            raise ValueError(f"load_format must be 'auto' or 'dummy', got {self.load_format!r}")
        if self.scheduling_policy not in SCHEDULING_POLICIES:
            raise ValueError(
                f"scheduling_policy must be one of {', '.join(SCHEDULING_POLICIES)}, got {self.scheduling_policy!r}"
            )
        if self.role not in ROLES:
            raise ValueError(f"role must be one of {', '.join(ROLES)}, got {self.role!r}")
        self._check_speculative()
        if not self.grammar_compile_timeout_s > 0:
            raise ValueError(f"grammar_compile_timeout_s must be > 0, got {self.grammar_compile_timeout_s}")
        for name in ("block_size", "max_num_seqs", "max_num_batched_tokens", "grammar_cache_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.model_config is None:
            self.model_config = ModelConfig.from_path(self.model)
        check_degree(self.model_config, self.tensor_parallel_size)
        limit = self.model_config.max_position_embeddings
        if self.max_model_len is None:
            self.max_model_len = limit
        elif not 1 <= self.max_model_len <= limit:
            raise ValueError(f"max_model_len must be in [1, {limit}] for this model, got {self.max_model_len}")
        if not self.enable_chunked_prefill and self.max_num_batched_tokens < self.max_model_len:
            raise ValueError(
                "without chunked prefill, max_num_batched_tokens must be >= max_model_len "
                f"({self.max_num_batched_tokens} < {self.max_model_len})"
            )

    def _resolve_weights(self) -> None:
        """Split a .gguf ``model`` into its folder and file, and settle ``quantization``."""
        if self.quantization not in QUANTIZATIONS:
            raise ValueError(f"quantization must be one of {', '.join(QUANTIZATIONS)}, got {self.quantization!r}")
        path = Path(self.model)
        if path.suffix == ".gguf":
            if self.quantization not in ("auto", "gguf"):
                raise ValueError(f"{path.name} is a GGUF file: its weights load with quantization 'gguf' only")
            self.model, self.gguf_file, self.quantization = str(path.parent), str(path), "gguf"
            return
        if self.quantization == "auto":
            has_gguf = path.is_dir() and any(path.glob("*.gguf"))
            has_floats = path.is_dir() and any(path.glob("*.safetensors"))
            self.quantization = "gguf" if has_gguf and not has_floats and self.load_format != "dummy" else "none"
        if self.quantization == "fp8":
            from engine.quant import fp8_supported

            ok, why = fp8_supported(torch.device(self.device))
            if not ok:
                raise ValueError(f"quantization 'fp8': {why}; use int8 or gguf on this device")
        if self.quantization == "gguf" and self.gguf_file is None:
            found = sorted(path.glob("*.gguf")) if path.is_dir() else []
            if len(found) != 1:
                raise ValueError(f"quantization 'gguf' needs exactly one .gguf file in {path} (found {len(found)}); "
                                 "or pass the file itself as the model")
            self.gguf_file = str(found[0])

    def _check_speculative(self) -> None:
        if self.speculative_method not in SPECULATIVE_METHODS:
            raise ValueError(f"speculative_method must be one of {', '.join(SPECULATIVE_METHODS)}, "
                             f"got {self.speculative_method!r}")
        if self.speculative_method == "draft" and not self.speculative_model:
            raise ValueError("speculative_method 'draft' needs speculative_model (the draft model's folder)")
        if not 1 <= self.num_speculative_tokens <= 16:
            raise ValueError(f"num_speculative_tokens must be in [1, 16], got {self.num_speculative_tokens}")
        if not 1 <= self.prompt_lookup_min <= self.prompt_lookup_max:
            raise ValueError(f"prompt lookup needs 1 <= prompt_lookup_min <= prompt_lookup_max, got "
                             f"{self.prompt_lookup_min}, {self.prompt_lookup_max}")
        if self.speculative_max_batch < 1 or not 0 <= self.speculative_min_acceptance < 1:
            raise ValueError("speculative_max_batch must be >= 1 and speculative_min_acceptance in [0, 1)")

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]


def check_degree(config: ModelConfig, size: int) -> None:
    """Raise ValueError, naming the flag, when ``size`` cannot split this model evenly."""
    flag = "--tensor-parallel-size"
    if size < 1:
        raise ValueError(f"{flag} must be >= 1, got {size}")
    if config.num_heads % size:
        raise ValueError(f"{flag} {size} does not divide the model's {config.num_heads} attention heads")
    if config.intermediate_size % size:
        raise ValueError(f"{flag} {size} does not divide the model's MLP width {config.intermediate_size}")
    kv = config.num_kv_heads
    if kv % size and size % kv:
        raise ValueError(f"{flag} {size} must divide the model's {kv} KV heads or be a multiple of them "
                         "(each KV head is then replicated on several ranks)")
