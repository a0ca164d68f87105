"""Stop strings, matched on the generated text as it streams.

Text that could still turn into a stop string is held back (at most the longest
stop string minus one character), so a client never sees the start of a stop
string that then completes; it is released as soon as it cannot match, and at
the end of the stream.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(slots=True)
class StopMatcher:
    stops: list[str]
    include_stop: bool = False
    pending: str = ""
    matched: str | None = None
    _hold: int = field(init=False)

    def __post_init__(self) -> None:
        self._hold = max((len(s) for s in self.stops), default=1) - 1

    def push(self, text: str) -> str:
        """The text that is safe to send now; sets ``matched`` when a stop string completes."""
        if self.matched is not None:
            return ""
        if not self.stops:
            return text
        # Search only where a new match can be: the held-back tail plus the new text.
        buf = self.pending + text
        hit = self._first_match(buf)
        if hit is not None:
            pos, stop = hit
            self.matched, self.pending = stop, ""
            return buf[: pos + len(stop)] if self.include_stop else buf[:pos]
        keep = self._partial_tail(buf)
        self.pending = buf[len(buf) - keep :] if keep else ""
        return buf[: len(buf) - keep]

    def flush(self) -> str:
        out, self.pending = self.pending, ""
        return out if self.matched is None else ""

    def _first_match(self, buf: str) -> tuple[int, str] | None:
        best = None
        for s in self.stops:
            i = buf.find(s)
            if i != -1 and (best is None or i < best[0]):
                best = (i, s)
        return best

    def _partial_tail(self, buf: str) -> int:
        """Length of the longest suffix of ``buf`` that is a proper prefix of some stop string."""
        for n in range(min(self._hold, len(buf)), 0, -1):
            tail = buf[-n:]
            if any(s.startswith(tail) for s in self.stops):
                return n
        return 0
