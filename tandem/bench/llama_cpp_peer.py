"""llama-cpp-python on a GGUF file: the peer of ``tandem bench quant``, run by it in llama-cpp-python's own
environment (``python llama_cpp_peer.py --model F.gguf``; it imports only llama_cpp and numpy). Prints one JSON
object: single-stream decode tokens/s after a 32- and a 1,024-token prompt, prefill tokens/s of 1,024 tokens,
and batched output tokens/s with B sequences per ``llama_decode`` (the low-level batch API, as llama.cpp's own
batched example and server run them), wall time including each prompt's prefill. With ``--workload F.json``
(``{"prompts": [[ids]], "output_lens": [n]}``, as ``tandem bench offline`` writes it) it runs that workload
instead, every request in one continuous batch that ends each sequence after its own output length.
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
    """``size`` random prompts of ``prompt_len`` tokens, ``new`` tokens each: the workload mode's loop with one
    length, plus the decode phase's own rate."""
    prompts = np.random.default_rng(size).integers(100, vocab_hi, (size, prompt_len)).tolist()
    out = workload(model_path, threads, prompts, [new] * size)
    out["decode_phase_tok_s"] = size * (new - 1) / (out["wall_s"] - out["prefill_s"])
    return out


class Batch:
    """One context with room for ``seqs`` sequences of ``ctx`` tokens in all, and its token batch."""

    def __init__(self, model_path: str, threads: int, seqs: int, ctx: int) -> None:
        import llama_cpp

        self.lib = llama_cpp
        self.model = llama_cpp.llama_model_load_from_file(model_path.encode(), llama_cpp.llama_model_default_params())
        self.n_vocab = llama_cpp.llama_vocab_n_tokens(llama_cpp.llama_model_get_vocab(self.model))
        cp = llama_cpp.llama_context_default_params()
        cp.n_ctx, cp.n_batch, cp.n_ubatch, cp.n_seq_max = ctx + 64, max(512, seqs), 512, seqs
        cp.n_threads = cp.n_threads_batch = threads
        self.n_batch = cp.n_batch
        self.ctx = llama_cpp.llama_init_from_model(self.model, cp)
        self.batch = llama_cpp.llama_batch_init(self.n_batch, 0, seqs)

    def decode(self, tokens: list[tuple[int, int, int, bool]]) -> None:
        """(token, position, sequence, wants logits) for each token, in one ``llama_decode``."""
        b = self.batch
        b.n_tokens = 0
        for i, (tok, pos, seq, logits) in enumerate(tokens):
            b.token[i], b.pos[i], b.n_seq_id[i], b.logits[i] = tok, pos, 1, logits
            b.seq_id[i][0] = seq
        b.n_tokens = len(tokens)
        assert self.lib.llama_decode(self.ctx, b) == 0

    def argmax(self, i: int) -> int:
        logits = self.lib.llama_get_logits_ith(self.ctx, i)
        return int(np.ctypeslib.as_array(logits, shape=(self.n_vocab,)).argmax())

    def close(self) -> None:
        self.lib.llama_batch_free(self.batch)
        self.lib.llama_free(self.ctx)
        self.lib.llama_model_free(self.model)


def workload(model_path: str, threads: int, prompts: list[list[int]], output_lens: list[int]) -> dict:
    """Every request at once: prompts prefilled in n_batch chunks (greedy first tokens), then one decode per
    step for every sequence still short of its output length. Output tokens/s over the whole wall time."""
    # llama.cpp gives each sequence n_ctx / n_seq_max positions: room for the longest in every slot
    longest = max(len(p) + n for p, n in zip(prompts, output_lens, strict=True))
    b = Batch(model_path, threads, len(prompts), len(prompts) * longest)
    t0 = time.perf_counter()
    work = [(tok, j, s, j == len(p) - 1) for s, p in enumerate(prompts) for j, tok in enumerate(p)]
    nxt, made = [0] * len(prompts), [1] * len(prompts)
    for c in range(0, len(work), b.n_batch):
        chunk = work[c : c + b.n_batch]
        b.decode(chunk)
        for k, (_, _, s, last) in enumerate(chunk):
            if last:
                nxt[s] = b.argmax(k)
    prefill = time.perf_counter() - t0
    while True:
        live = [s for s in range(len(prompts)) if made[s] < output_lens[s]]
        if not live:
            break
        b.decode([(nxt[s], len(prompts[s]) + made[s] - 1, s, True) for s in live])
        for k, s in enumerate(live):
            nxt[s] = b.argmax(k)
            made[s] += 1
    wall = time.perf_counter() - t0
    b.close()
    return {"out_tok_s": sum(output_lens) / wall, "wall_s": wall, "prefill_s": prefill}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", required=True)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--batch-sizes", default="8,32,64")
    p.add_argument("--batch-prompt-len", type=int, default=128)
    p.add_argument("--workload", help="a JSON workload to run instead (prompts, output_lens)")
    a = p.parse_args()
    if a.workload:
        import llama_cpp

        with open(a.workload) as f:
            w = json.load(f)
        out = workload(a.model, a.threads, w["prompts"], w["output_lens"])
        print(json.dumps({"version": llama_cpp.__version__, **out}))
        return
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
