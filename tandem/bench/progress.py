"""A progress line on stderr, no dependency: redrawn in place ten times a second on a terminal,
a new line every ten seconds in a log (where redraws would pile up)."""

from __future__ import annotations

import sys
import time
from typing import TextIO

WIDTH = 30
REDRAW_S = 0.1
LOG_EVERY_S = 10.0


class Progress:
    def __init__(self, total: int, label: str, out: TextIO | None = None, enabled: bool = True) -> None:
        self.total = max(total, 1)
        self.label = label
        self.out = out or sys.stderr
        self.enabled = enabled
        self.tty = self.out.isatty()
        self.done = 0
        self.failed = 0
        self.start = time.perf_counter()
        self._drawn = self.start if not self.tty else 0.0

    def update(self, inflight: int, ok: bool = True) -> None:
        """One request finished; ``inflight`` is how many are still running."""
        self.done += 1
        self.failed += not ok
        self.draw(inflight, force=self.done == self.total)

    def draw(self, inflight: int, force: bool = False) -> None:
        now = time.perf_counter()
        if not self.enabled or (not force and now - self._drawn < (REDRAW_S if self.tty else LOG_EVERY_S)):
            return
        self._drawn = now
        filled = WIDTH * self.done // self.total
        failed = f", {self.failed} failed" if self.failed else ""
        line = (f"  {self.label} [{'#' * filled}{'.' * (WIDTH - filled)}] {self.done}/{self.total} done, "
                f"{inflight} in flight{failed}, {now - self.start:.1f} s")
        self.out.write(f"\r{line} " if self.tty else line + "\n")
        self.out.flush()

    def close(self) -> None:
        if self.enabled and self.tty:
            self.out.write("\n")
            self.out.flush()
