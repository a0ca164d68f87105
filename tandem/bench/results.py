"""What one load level of a serving benchmark produced: shared by the runner, its report and its plots."""

from __future__ import annotations

from dataclasses import asdict, dataclass

from tandem.bench.metrics import RequestRecord, record_to_json
from tandem.bench.report import format_rate
from tandem.bench.timeline import TimelineSample


@dataclass(slots=True)
class Load:
    rate: float
    burstiness: float = 1.0
    max_concurrency: int | None = None


@dataclass
class RunResult:
    """One rate's run: every request's record, the timeline, and the figures."""

    load: Load
    records: list[RequestRecord]
    t0: float
    duration: float
    timeline: list[TimelineSample]
    metrics: dict

    def to_json(self) -> dict:
        return {"rate": format_rate(self.load.rate), "burstiness": self.load.burstiness,
                "max_concurrency": self.load.max_concurrency, "metrics": self.metrics,
                "timeline": [asdict(s) for s in self.timeline],
                "requests": [record_to_json(r, self.t0) for r in self.records]}
