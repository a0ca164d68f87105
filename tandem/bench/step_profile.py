"""``tandem bench offline --scenarios step-profile``: where a decode step's time goes, op class by op class.

The engine runs a real batch (N requests with 128-token prompts, decoding) while thin wrappers around its
kernels, attention backend and sampler time every call. Each op class is set against its own roofline,
``max(bytes / read bandwidth, FLOPs / GEMM rate)``, with both rates measured in the same run (the GEMM rate
as the faster of oneDNN and the engine's own kernel, the bandwidth just before each batch): a step far
from the sum of those rooflines shows which op to fix. "other" is what the step spends outside the
timed ops (metadata, embedding, Python between calls). Plain steps run as the engine runs them (decode steps
through the compiled decode stack where there is one, which has no Python between calls); timed steps run the
Python forward, whose calls the wrappers see; "other" is the plain step less the timed ops, never below zero.
Prefill of a 1,024-token prompt is profiled the same way and its FLOP rate set against the measured GEMM rate.
"""

from __future__ import annotations

import random
import time
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from engine import Engine, SamplingParams
from tandem.bench.timing import best_of, timed

OP_CLASSES = ("linear", "attention", "norm/rope/act", "sampling", "other")
BATCH_SIZES = (1, 16, 64, 256)
PROMPT_LEN = 128


@dataclass(slots=True)
class OpCost:
    seconds: float = 0.0
    bytes: float = 0.0
    flops: float = 0.0
    calls: int = 0


@dataclass(slots=True)
class Recorder:
    costs: dict[str, OpCost] = field(default_factory=lambda: defaultdict(OpCost))
    plain: tuple = ()  # the engine's kernels, attention backend and sampler, unwrapped (see ``instrument``)
    timed_parts: tuple = ()

    def timed(self, op: str, fn: Callable[[], Any], nbytes: float = 0.0, flops: float = 0.0) -> Any:
        t = time.perf_counter()
        out = fn()
        c = self.costs[op]
        c.seconds += time.perf_counter() - t
        c.bytes += nbytes
        c.flops += flops
        c.calls += 1
        return out

    def reset(self) -> None:
        self.costs.clear()


class TimedKernels:
    """The engine's kernels with every call timed and costed (bytes moved, FLOPs)."""

    def __init__(self, inner: Any, rec: Recorder) -> None:
        self.inner, self.rec = inner, rec

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def linear(self, x: torch.Tensor, weight: Any, bias: torch.Tensor | None = None) -> torch.Tensor:
        return self._matmul(lambda: self.inner.linear(x, weight, bias), x, weight, x.element_size())

    def gate_up_silu(self, x: torch.Tensor, weight: Any) -> torch.Tensor:
        """The gate/up projection with its activation (fused into the matmul on packed weights): "linear",
        writing half the projection's columns."""
        return self._matmul(lambda: self.inner.gate_up_silu(x, weight), x, weight, x.element_size() / 2)

    def logits(self, x: torch.Tensor, weight: Any) -> torch.Tensor:
        return self._matmul(lambda: self.inner.logits(x, weight), x, weight, 4)  # float32 out

    def _matmul(self, fn: Callable[[], Any], x: torch.Tensor, weight: Any, out_bytes: float) -> Any:
        """A "linear" call of x [m, k] against an [n, k] weight: the weight and x read, m x n outputs of
        ``out_bytes`` each written."""
        m, k = x.shape
        n = weight.shape[0]
        moved = weight.nbytes + m * k * x.element_size() + m * n * out_bytes
        return self.rec.timed("linear", fn, moved, 2.0 * m * n * k)

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        return self.rec.timed("norm/rope/act", lambda: self.inner.rms_norm(x, weight, eps), 2 * x.nbytes)

    def add_rms_norm_(self, residual: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor,
                      eps: float) -> torch.Tensor:
        return self.rec.timed("norm/rope/act", lambda: self.inner.add_rms_norm_(residual, delta, weight, eps),
                              4 * residual.nbytes)

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        return self.rec.timed("norm/rope/act", lambda: self.inner.silu_mul(gate_up), 1.5 * gate_up.nbytes)

    def rope_(self, qkv: torch.Tensor, tables: Any, num_heads: int, head_dim: int) -> None:
        moved = 2 * qkv.shape[0] * num_heads * head_dim * qkv.element_size()
        self.rec.timed("norm/rope/act", lambda: self.inner.rope_(qkv, tables, num_heads, head_dim), moved)


class TimedAttention:
    """The attention backend with each layer's call costed by the K/V it must read."""

    def __init__(self, inner: Any, rec: Recorder) -> None:
        self.inner, self.rec = inner, rec
        self._meta: Any = None  # the step whose key counts are cached: every layer shares its metadata
        self._keys = self._pairs = 0.0

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv: torch.Tensor, meta: Any) -> Any:
        a = self.inner
        if meta is not self._meta:  # once per step, not per layer: the step's "other" would carry it 30 times
            self._meta = meta
            self._keys = sum(int(g.context_lens.sum()) for g in meta.decodes)
            self._keys += sum(s.context_len for s in meta.prefills)
            self._pairs = self._keys + sum(s.length * s.context_len / 2 for s in meta.prefills)  # causal pairs
        row = a.num_kv_heads * a.head_dim * kv.element_size()  # one token's K (or V) of one layer
        moved = 2 * self._keys * row + 2 * q.nbytes
        flops = 4.0 * self._pairs * a.num_heads * a.head_dim
        return self.rec.timed("attention", lambda: a.forward(q, k, v, kv, meta), moved, flops)


class TimedSampler:
    def __init__(self, inner: Any, rec: Recorder) -> None:
        self.inner, self.rec = inner, rec

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def sample(self, logits: torch.Tensor, requests: list) -> Any:
        return self.rec.timed("sampling", lambda: self.inner.sample(logits, requests), logits.nbytes)


def instrument(engine: Engine) -> Recorder:
    """Wrap ``engine``'s kernels, attention and sampler in timers (for the rest of its life; ``timing`` switches
    them off and on)."""
    rec = Recorder()
    runner = engine.runner
    model = runner.model
    rec.plain = (model.kernels, runner.attn, engine.sampler, model.decode_stack)
    rec.timed_parts = (TimedKernels(model.kernels, rec), TimedAttention(runner.attn, rec),
                       TimedSampler(engine.sampler, rec), None)
    timing(engine, rec, True)
    return rec


def timing(engine: Engine, rec: Recorder, on: bool) -> None:
    """The engine's own kernels, attention, sampler and compiled decode stack (off), or their timed wrappers
    and the Python forward, whose calls they see (on)."""
    model = engine.runner.model
    model.kernels, engine.runner.attn, engine.sampler, model.decode_stack = rec.timed_parts if on else rec.plain


def gemm_rate_gflops(dtype: torch.dtype, kernels: Any = None, device: str = "cpu") -> float:
    """Best of 5 ``torch.mm`` (oneDNN on CPU) at a prefill-like shape, or of the engine's own linear kernel on
    the same shape where that is faster (the packed float32 kernel runs ~2x oneDNN's float32 GEMM): what this
    machine's GEMM reaches, so that no op can beat its roofline by running a faster kernel than the yardstick's.
    bfloat16 on CPU is held to float32's rate at least: its values widen to float32 exactly, so a CPU without
    bfloat16 arithmetic can multiply them at its float32 rate (on an AVX2 EPYC the best bfloat16 kernel, the
    row-streaming one, read 17 GFLOP/s against float32's 77: the fallback, not the machine, was the yardstick).
    On a GPU at 4,096 cubed: the CPU's shape is done in microseconds there, far from the GPU's peak."""
    if dtype == torch.bfloat16 and torch.device(device).type == "cpu":
        return max(_gemm_rate(dtype, kernels, device), _gemm_rate(torch.float32, kernels, device))
    return _gemm_rate(dtype, kernels, device)


def _gemm_rate(dtype: torch.dtype, kernels: Any, device: str) -> float:
    m, k, n = (1024, 2048, 2048) if torch.device(device).type == "cpu" else (4096, 4096, 4096)
    a, b = torch.randn(m, k, device=device).to(dtype), torch.randn(k, n, device=device).to(dtype)
    torch.mm(a, b)
    best = best_of(5, lambda: torch.mm(a, b), device)
    if kernels is not None:
        w = kernels.prepare_weight(b.t().contiguous())
        kernels.linear(a, w)
        best = min(best, best_of(5, lambda: kernels.linear(a, w), device))
    return 2.0 * m * k * n / best / 1e9


def profile_decode(engine: Engine, rec: Recorder, batch: int, vocab: int, seed: int, steps: int,
                   bw: float, gemm: float) -> dict:
    """The median of ``steps`` plain decode steps with ``batch`` requests running (all of them decoding: none ends
    while later prompts are still being prefilled, and the rest are aborted after), and the op costs of the
    median of as many timed steps taken in between. "other" is the plain step less the timed ops."""
    rng = random.Random(seed)
    budget = engine.config.max_num_batched_tokens
    params = SamplingParams(max_tokens=prefill_steps(batch, budget) + 2 * steps + 4, temperature=0, ignore_eos=True)
    ids = [engine.add_request([rng.randrange(100, vocab - 100) for _ in range(PROMPT_LEN)], params)
           for _ in range(batch)]
    while engine.scheduler.waiting or any(r.num_output_tokens == 0 for r in engine.scheduler.running):
        engine.step()
    per_step: list[tuple[float, dict[str, OpCost]]] = []
    plain: list[float] = []
    for _ in range(steps):  # timed and plain steps alternate: the wrappers' own Python (~0.3 ms a step at batch
        assert len(engine.scheduler.running) == batch  # 16) stays out of the step time
        rec.reset()
        per_step.append((timed(engine.step), {k: replace(v) for k, v in rec.costs.items()}))
        timing(engine, rec, False)
        plain.append(timed(engine.step))
        timing(engine, rec, True)
    for rid in ids:
        engine.abort(rid)
    timed_s, costs = sorted(per_step, key=lambda p: p[0])[steps // 2]  # the median timed step's op costs
    step_s = sorted(plain)[steps // 2]
    return {"batch": batch, "timed_step_ms": timed_s * 1e3, **summarize(costs, step_s, bw, gemm)}


def prefill_steps(batch: int, budget: int) -> int:
    """Steps that prefilling ``batch`` prompts takes at ``budget`` tokens per step, rounded up."""
    return -(-batch * PROMPT_LEN // budget) + 1


def profile_prefill(engine: Engine, rec: Recorder, vocab: int, seed: int, bw: float, gemm: float,
                    tokens: int = 1024, trials: int = 3) -> dict:
    """One 1,024-token prompt prefilled in one step (the best of ``trials``), against the GEMM rate."""
    rng = random.Random(seed)
    best: tuple[float, dict[str, OpCost]] | None = None
    for _ in range(trials):
        engine.reset_prefix_cache()
        engine.add_request([rng.randrange(100, vocab - 100) for _ in range(tokens)],
                           SamplingParams(max_tokens=1, temperature=0, ignore_eos=True))
        rec.reset()
        t = timed(engine.step)
        assert not engine.has_unfinished(), "the prompt must fit one step (max_num_batched_tokens)"
        if best is None or t < best[0]:
            best = (t, dict(rec.costs))
    t, costs = best
    row = summarize(costs, t, bw, gemm)
    flops = sum(c.flops for c in costs.values())
    return {"prompt_tokens": tokens, "tok_s": tokens / t, "gflop_s": flops / t / 1e9,
            "fraction_of_gemm_rate": flops / t / 1e9 / gemm, **row}


def summarize(costs: dict[str, OpCost], step_s: float, bw: float, gemm: float) -> dict:
    """Per op class: ms, share of the step, achieved GB/s and GFLOP/s, its roofline ms and the gap."""
    other = max(0.0, step_s - sum(c.seconds for c in costs.values()))
    ops = {}
    roof_total = 0.0
    for name in OP_CLASSES:
        c = costs.get(name, OpCost(seconds=other) if name == "other" else OpCost())
        roof = max(c.bytes / (bw * 1e9), c.flops / (gemm * 1e9))
        roof_total += roof
        ops[name] = {
            "ms": c.seconds * 1e3, "share": c.seconds / step_s, "calls": c.calls,
            "gb_s": c.bytes / c.seconds / 1e9 if c.seconds else 0.0,
            "gflop_s": c.flops / c.seconds / 1e9 if c.seconds else 0.0,
            "roofline_ms": roof * 1e3, "over_roofline": c.seconds / roof if roof else None,
        }
    return {"step_ms": step_s * 1e3, "roofline_ms": roof_total * 1e3, "step_over_roofline": step_s / roof_total,
            "ops": ops}


def step_profile(make: Callable[..., Engine], dtype: str, vocab: int, seed: int, bw: float,
                 batches: tuple[int, ...] = BATCH_SIZES, steps: int = 12,
                 measure_bw: Callable[[], float] | None = None) -> dict:
    """The decode profile at each batch size and the 1,024-token prefill, for one dtype. With ``measure_bw``,
    each batch's rooflines use the read bandwidth measured just before it: on a shared machine it moved
    between 28 and 70 GB/s within minutes, and a roofline from another minute misstates the step's gap."""
    budget, most = max(1024, max(batches)), max(batches)
    blocks = most * -(-(PROMPT_LEN + prefill_steps(most, budget) + 2 * steps + 8) // 16) + 128
    engine = make(dtype=dtype, max_num_seqs=most, max_num_batched_tokens=budget, num_kv_blocks=blocks,
                  enable_prefix_caching=False)
    gemm = gemm_rate_gflops(getattr(torch, dtype), engine.runner.model.kernels)
    rec = instrument(engine)
    engine.generate([[100 + i for i in range(32)]] * 2)  # warm-up
    decode = []
    for b in batches:
        bw_now = measure_bw() if measure_bw else bw
        decode.append({**profile_decode(engine, rec, b, vocab, seed + b, steps, bw_now, gemm), "read_bw_gbps": bw_now})
    # the yardstick again, with the plain kernels: on a shared AMX host one reading came out at a third of
    # another taken shortly before, and prefill then ran at 128% of it; the better reading is the machine's
    timing(engine, rec, False)
    prefill_gemm = max(gemm, gemm_rate_gflops(getattr(torch, dtype), engine.runner.model.kernels))
    timing(engine, rec, True)
    prefill = {**profile_prefill(engine, rec, vocab, seed, bw, prefill_gemm), "gemm_gflop_s": prefill_gemm}
    assert engine.num_free_blocks == engine.num_total_blocks
    return {"dtype": dtype, "gemm_gflop_s": gemm, "read_bw_gbps": bw, "decode": decode, "prefill": prefill}


def format_profile(result: dict) -> str:
    """Markdown: one row per (batch, op class), then the prefill line."""
    lines = [f"step profile, {result['dtype']}: GEMM {result['gemm_gflop_s']:.0f} GFLOP/s, "
             f"read {result['read_bw_gbps']:.1f} GB/s (same run)",
             "| batch | op | ms | share | GB/s | GFLOP/s | roofline ms | x roofline |",
             "|---|---|---|---|---|---|---|---|"]
    bws = {round(d["read_bw_gbps"], 1) for d in result["decode"]}
    for d in result["decode"]:
        for name, o in d["ops"].items():
            over = "-" if o["over_roofline"] is None else f"{o['over_roofline']:.1f}x"
            lines.append(f"| {d['batch']} | {name} | {o['ms']:.2f} | {o['share'] * 100:.0f}% | {o['gb_s']:.1f} | "
                         f"{o['gflop_s']:.0f} | {o['roofline_ms']:.2f} | {over} |")
        read = f" (read {d['read_bw_gbps']:.1f} GB/s)" if len(bws) > 1 else ""
        lines.append(f"| {d['batch']} | **step**{read} | **{d['step_ms']:.2f}** | | | | {d['roofline_ms']:.2f} | "
                     f"**{d['step_over_roofline']:.2f}x** |")
    p = result["prefill"]
    lines.append(f"prefill {p['prompt_tokens']} tokens: {p['step_ms']:.0f} ms, {p['tok_s']:.0f} tok/s, "
                 f"{p['gflop_s']:.0f} GFLOP/s = {p['fraction_of_gemm_rate'] * 100:.0f}% of the GEMM rate of "
                 f"{p['gemm_gflop_s']:.0f} (the better of two readings; linear {p['ops']['linear']['gflop_s']:.0f} "
                 f"GFLOP/s, attention {p['ops']['attention']['ms']:.0f} ms)")
    return "\n".join(lines)
