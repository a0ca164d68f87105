"""The serving benchmark's arithmetic: from what each request saw to the report's figures.

Everything is measured at the client, as a user of the API would see it (the definitions
of ``vllm bench serve``):

- TTFT: the request's send -> the first message that carries tokens.
- ITL: the gaps between consecutive tokens; tokens that arrive in one message are stamped
  alike, so their gaps are 0 (the user saw them at once).
- TPOT: (e2e - TTFT) / (output tokens - 1), one value per request with >= 2 tokens: the
  decode speed a request saw, its pauses included.
- E2E latency: the send -> the last token.
- Throughput: completed requests and tokens over the run's duration, which runs from the
  first scheduled send to the last completion.
- Goodput: completed requests per second that met every SLO given.

Kept apart from the I/O so that tests can check it on recorded timelines.
"""

from __future__ import annotations

import math
import re
from dataclasses import asdict, dataclass, field

PERCENTILES = (50, 90, 99)
SLO_KEYS = {"ttft": "ttft", "tpot": "tpot", "itl": "itl", "e2el": "e2el", "e2e": "e2el"}
_DURATION = re.compile(r"^\s*([0-9]*\.?[0-9]+)\s*(ms|s)?\s*$")


@dataclass(slots=True)
class RequestRecord:
    """What the client saw of one request; times are ``time.perf_counter()`` seconds."""

    send: float  # when the request went out (after any wait for a concurrency slot)
    prompt_len: int  # what the workload asked for
    expected_output: int
    token_times: list[float] = field(default_factory=list)  # one arrival stamp per output token
    end: float | None = None  # the stream's end (set on success and on failure)
    prompt_tokens: int = 0  # what the server reported (usage); 0 when it does not say
    cached_tokens: int = 0
    error: str = ""
    server_ttft_ms: float | None = None  # the TTFT the server reports for it (tandem's timings), when it does

    @property
    def ok(self) -> bool:
        return not self.error and bool(self.token_times)

    @property
    def output_tokens(self) -> int:
        return len(self.token_times)

    @property
    def ttft(self) -> float:
        return self.token_times[0] - self.send

    @property
    def e2e(self) -> float:
        return self.token_times[-1] - self.send

    @property
    def tpot(self) -> float | None:
        """None with fewer than two tokens: there is no decode to time."""
        n = len(self.token_times)
        return (self.e2e - self.ttft) / (n - 1) if n > 1 else None

    @property
    def itls(self) -> list[float]:
        t = self.token_times
        return [b - a for a, b in zip(t, t[1:], strict=False)]


def percentile(values: list[float], p: float) -> float:
    """Linear interpolation between the closest ranks (numpy's default); NaN for no values."""
    if not values:
        return math.nan
    ordered = sorted(values)
    k = (len(ordered) - 1) * p / 100
    lo = math.floor(k)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (k - lo)


def latencies(done: list[RequestRecord], key: str) -> list[float]:
    """One kind of latency of completed requests, in seconds: ``ttft``, ``tpot`` (requests with two tokens
    or more) and ``e2el`` one per request, ``itl`` one per gap between tokens."""
    if key == "itl":
        return [g for r in done for g in r.itls]
    if key == "tpot":
        return [t for r in done if (t := r.tpot) is not None]
    if key == "ttft":
        return [r.ttft for r in done]
    if key == "e2el":
        return [r.e2e for r in done]
    raise ValueError(f"no latency {key!r}")


def summarize_ms(seconds: list[float]) -> dict[str, float]:
    """mean, median, p90, p99 (and std) in milliseconds."""
    ms = [s * 1000 for s in seconds]
    mean = sum(ms) / len(ms) if ms else math.nan
    std = math.sqrt(sum((x - mean) ** 2 for x in ms) / len(ms)) if ms else math.nan
    out = {"mean": mean, "std": std}
    out.update({("median" if p == 50 else f"p{p}"): percentile(ms, p) for p in PERCENTILES})
    return out


def parse_duration_ms(text: str) -> float:
    """``"500ms"`` -> 500.0, ``"1.5s"`` -> 1500.0, ``"200"`` -> 200.0 (milliseconds by default)."""
    m = _DURATION.match(text)
    if not m:
        raise ValueError(f"{text!r} is not a duration such as 500ms or 1.5s")
    value = float(m.group(1))
    return value * 1000 if m.group(2) == "s" else value


def parse_slo(text: str) -> dict[str, float]:
    """``"ttft=500ms,tpot=100ms"`` -> ``{"ttft": 500.0, "tpot": 100.0}`` (milliseconds).

    Keys: ttft, tpot, e2el (or e2e), and itl, which a request meets when *every* gap
    between its tokens is within the bound (no stall a reader would notice).
    """
    slo: dict[str, float] = {}
    for item in filter(None, (part.strip() for part in text.split(","))):
        key, sep, value = item.partition("=")
        key = key.strip().lower()
        if not sep or key not in SLO_KEYS:
            raise ValueError(f"bad SLO {item!r}: expected KEY=DURATION with KEY one of ttft, tpot, itl, e2el")
        slo[SLO_KEYS[key]] = parse_duration_ms(value)
    return slo


def meets_slo(record: RequestRecord, slo: dict[str, float]) -> bool:
    """Whether a completed request met every bound of ``slo`` (milliseconds)."""
    if not record.ok:
        return False
    tpot = record.tpot
    seen = {"ttft": record.ttft, "tpot": tpot if tpot is not None else 0.0, "e2el": record.e2e,
            "itl": max(record.itls, default=0.0)}
    return all(seen[key] * 1000 <= bound for key, bound in slo.items())


def compute_metrics(records: list[RequestRecord], duration: float, slo: dict[str, float] | None = None) -> dict:
    """The report's figures for one run of ``duration`` seconds (JSON-ready; latencies in ms)."""
    done = [r for r in records if r.ok]
    slo = slo or {}
    out_tokens = sum(r.output_tokens for r in done)
    in_tokens = sum(r.prompt_tokens or r.prompt_len for r in done)
    reported = [r for r in done if r.prompt_tokens]
    good = sum(meets_slo(r, slo) for r in done)
    per_s = (lambda x: x / duration) if duration > 0 else (lambda x: math.nan)
    return {
        "completed": len(done),
        "failed": len(records) - len(done),
        "duration_s": duration,
        "total_input_tokens": in_tokens,
        "total_output_tokens": out_tokens,
        "request_throughput": per_s(len(done)),
        "output_throughput": per_s(out_tokens),
        "total_token_throughput": per_s(in_tokens + out_tokens),
        "goodput": per_s(good) if slo else None,
        "good_requests": good if slo else None,
        "slo_ms": slo,
        "prefix_cache_hit_rate": (sum(r.cached_tokens for r in reported) / sum(r.prompt_tokens for r in reported)
                                  if reported else None),
        "short_outputs": sum(r.output_tokens < r.expected_output for r in done),
        "ttft_ms": summarize_ms(latencies(done, "ttft")),
        "tpot_ms": summarize_ms(latencies(done, "tpot")),
        "itl_ms": summarize_ms(latencies(done, "itl")),
        "e2el_ms": summarize_ms(latencies(done, "e2el")),
        "errors": _error_counts(records),
    }


def _error_counts(records: list[RequestRecord]) -> dict[str, int]:
    counts: dict[str, int] = {}
    for r in records:
        if not r.ok:
            key = r.error or "no tokens"
            counts[key] = counts.get(key, 0) + 1
    return counts


def record_to_json(record: RequestRecord, t0: float) -> dict:
    """One request for the result file: times relative to the run's start, in seconds."""
    d = asdict(record)
    d["send"] = record.send - t0
    d["end"] = None if record.end is None else record.end - t0
    d["token_times"] = [round(t - t0, 6) for t in record.token_times]
    return d
