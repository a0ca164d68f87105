"""llama-cpp-python on a GGUF file: the peer of ``tandem bench quant``, run by it in llama-cpp-python's own
environment (``python llama_cpp_peer.py --model F.gguf``; it imports only llama_cpp and numpy). Prints one JSON
object: single-stream decode tokens/s after a 32- and a 1,024-token prompt, prefill tokens/s of 1,024 tokens,
and batched output tokens/s with B sequences per ``llama_decode`` (the low-level batch API, as llama.cpp's own
batched example and server run them), wall time including each prompt's prefill.
"""

from __future__ import annotations

import argparse
import json
import time

import numpy as np


def single(llm, prompt: list[int], new: int) -> tuple[float, float]:
    """(prefill seconds, decode tokens/s over the new tokens after the first)."""
    llm.reset()
    t = time.perf_counter()
    llm.eval(prompt)
    prefill = time.perf_counter() - t
    n, first = 0, None
    for _ in llm.generate(prompt, temp=0.0):  # the prompt is cached: generate samples at once
        n += 1
        first = first or time.perf_counter()
        if n >= new:
            break
    return prefill, (new - 1) / (time.perf_counter() - first)


def batched(model_path: str, threads: int, size: int, prompt_len: int, new: int, vocab_hi: int) -> dict:
    import llama_cpp

    model = llama_cpp.llama_model_load_from_file(model_path.encode(), llama_cpp.llama_model_default_params())
    vocab = llama_cpp.llama_model_get_vocab(model)
    n_vocab = llama_cpp.llama_vocab_n_tokens(vocab)
    cp = llama_cpp.llama_context_default_params()
    cp.n_ctx, cp.n_batch, cp.n_ubatch, cp.n_seq_max = size * (prompt_len + new) + 64, max(512, size), 512, size
    cp.n_threads = cp.n_threads_batch = threads
    ctx = llama_cpp.llama_init_from_model(model, cp)
    batch = llama_cpp.llama_batch_init(max(512, size), 0, size)

    def add(tok: int, pos: int, seq: int, logits: bool) -> None:
        i = batch.n_tokens
        batch.token[i], batch.pos[i], batch.n_seq_id[i], batch.logits[i] = tok, pos, 1, logits
        batch.seq_id[i][0] = seq
        batch.n_tokens += 1

    def argmax(i: int) -> int:
        return int(np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(ctx, i), shape=(n_vocab,)).argmax())

    prompts = np.random.default_rng(size).integers(100, vocab_hi, (size, prompt_len))
    t0 = time.perf_counter()
    work = [(s, j, int(prompts[s, j])) for s in range(size) for j in range(prompt_len)]
    nxt = [0] * size
    for c in range(0, len(work), cp.n_batch):
        batch.n_tokens = 0
        chunk = work[c : c + cp.n_batch]
        for s, j, tok in chunk:
            add(tok, j, s, j == prompt_len - 1)
        assert llama_cpp.llama_decode(ctx, batch) == 0
        for k, (s, j, _) in enumerate(chunk):
            if j == prompt_len - 1:
                nxt[s] = argmax(k)
    prefill = time.perf_counter() - t0
    for step in range(new - 1):
        batch.n_tokens = 0
        for s in range(size):
            add(nxt[s], prompt_len + step, s, True)
        assert llama_cpp.llama_decode(ctx, batch) == 0
        nxt = [argmax(s) for s in range(size)]
    wall = time.perf_counter() - t0
    llama_cpp.llama_batch_free(batch)
    llama_cpp.llama_free(ctx)
    llama_cpp.llama_model_free(model)
    return {"out_tok_s": size * new / wall, "decode_phase_tok_s": size * (new - 1) / (wall - prefill),
            "wall_s": wall, "prefill_s": prefill}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", required=True)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--batch-sizes", default="8,32,64")
    p.add_argument("--batch-prompt-len", type=int, default=128)
    a = p.parse_args()
    import llama_cpp
    from llama_cpp import Llama

    llm = Llama(model_path=a.model, n_threads=a.threads, n_threads_batch=a.threads, n_ctx=2048, n_batch=512,
                verbose=False)
    hi = llm.n_vocab() - 100
    rng = np.random.default_rng(0)
    p32, p1024 = rng.integers(100, hi, 32).tolist(), rng.integers(100, hi, 1024).tolist()
    single(llm, p32, 16)  # warm-up
    _, d32 = single(llm, p32, a.new_tokens)
    prefill, d1024 = single(llm, p1024, a.new_tokens)
    out = {"version": llama_cpp.__version__, "decode_32_tok_s": d32, "decode_1024_tok_s": d1024,
           "prefill_1024_tok_s": 1024 / prefill, "batch": {}}
    del llm
    for size in [int(b) for b in a.batch_sizes.split(",") if b]:
        out["batch"][str(size)] = batched(a.model, a.threads, size, a.batch_prompt_len, a.new_tokens, hi)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
