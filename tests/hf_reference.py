"""Hugging Face transformers as the outside referee: greedy tokens and logprobs."""

from __future__ import annotations

from pathlib import Path

import torch


def load_hf(model_dir: Path, dtype: torch.dtype = torch.float32):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).eval()


def _generate(model, prompt: list[int], max_new_tokens: int, **kwargs):
    ids = torch.tensor([prompt])
    with torch.inference_mode():
        return model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            do_sample=False,
            max_new_tokens=max_new_tokens,
            pad_token_id=0,
            **kwargs,
        )


def hf_greedy(model, prompt: list[int], max_new_tokens: int, **kwargs) -> list[int]:
    """Greedy continuation; stops after the model's EOS token, as the engine does without ignore_eos."""
    return _generate(model, prompt, max_new_tokens, **kwargs)[0, len(prompt) :].tolist()


def hf_greedy_logprobs(model, prompt: list[int], max_new_tokens: int) -> tuple[list[int], list[torch.Tensor]]:
    """Greedy tokens and the raw log-softmax of the logits at every generated position."""
    out = _generate(model, prompt, max_new_tokens, output_logits=True, return_dict_in_generate=True)
    tokens = out.sequences[0, len(prompt) :].tolist()
    return tokens, [torch.log_softmax(step[0].float(), dim=-1) for step in out.logits]
