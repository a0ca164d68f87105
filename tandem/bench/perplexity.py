"""Perplexity of the engine's own model (its kernels, its quantized weights) on a fixed text.

The text is scored in independent windows (each window's first token is context only), one prefill per window
through ``LlamaModel.forward``, so the figure measures exactly the weights and kernels that serve requests.
``decode_kernels`` sends every quantized matmul through the integer kernel that decode steps use (int8
activations), not the dequantize-then-GEMM path that long prefills take.
"""

from __future__ import annotations

import math
from dataclasses import replace
from pathlib import Path

import torch

TEXT = Path(__file__).parent / "data" / "perplexity.txt"


def text_tokens(model_dir: str | Path) -> list[int]:
    """The bundled text, tokenized by the model's tokenizer (no special tokens)."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(Path(model_dir) / "tokenizer.json"))
    return tok.encode(TEXT.read_text(), add_special_tokens=False).ids


@torch.inference_mode()
def window_logits(runner, tokens: list[int]) -> torch.Tensor:
    """Logits after each of tokens[:-1] (what predicts tokens[1:]), from one prefill of the window."""
    from engine.attention import build_metadata

    n, bs = len(tokens), runner.block_size
    meta = build_metadata([(0, n, list(range(-(-n // bs))))], bs, runner.device, runner.attn.groups_by_length)
    ids = torch.tensor(tokens, dtype=torch.long, device=runner.device)
    hidden = runner.model.forward(ids, torch.arange(n, device=runner.device), runner.kv_caches, meta, runner.attn)
    return runner.model.logits(hidden[:-1])


def window_nll(runner, tokens: list[int]) -> tuple[float, int]:
    """Summed negative log-likelihood of tokens[1:] given their prefixes, and how many were scored."""
    logprobs = torch.log_softmax(window_logits(runner, tokens), dim=-1)
    targets = torch.tensor(tokens[1:], dtype=torch.long, device=logprobs.device)
    return -logprobs.gather(1, targets[:, None]).sum().item(), len(tokens) - 1


def integer_kernels_only(runner) -> None:
    """Every quantized matmul through the integer kernel decode steps use, at any row count (CPU kernels only)."""
    kernels = runner.model.kernels
    if hasattr(kernels, "quant_gemm_rows"):
        kernels.quant_gemm_rows = dict.fromkeys(kernels.quant_gemm_rows, 1 << 30)


def perplexity(config, tokens: list[int], window: int = 512, decode_kernels: bool = False) -> float:
    """exp(mean NLL) over ``tokens`` in windows of ``window`` tokens, on a runner built from ``config``."""
    from engine.model_runner import ModelRunner

    runner = ModelRunner(replace(config, num_kv_blocks=-(-window // config.block_size)))
    if decode_kernels:
        integer_kernels_only(runner)
    total, count = 0.0, 0
    for start in range(0, len(tokens) - 1, window):
        chunk = tokens[start : start + window]
        if len(chunk) < 2:
            break
        nll, n = window_nll(runner, chunk)
        total, count = total + nll, count + n
    return math.exp(total / count)
