"""A one-line progress bar on stderr (no dependency; silent when stderr is not a terminal
unless forced)."""

from __future__ import annotations

import sys
import time


class Progress:
    def __init__(self, total: int, label: str = "", enabled: bool | None = None):
        self.total, self.done, self.label = max(total, 1), 0, label
        self.enabled = sys.stderr.isatty() if enabled is None else enabled
        self.start = time.time()

    def step(self, what: str = "") -> None:
        self.done += 1
        if not self.enabled:
            return
        frac = self.done / self.total
        bar = "#" * int(30 * frac) + "-" * (30 - int(30 * frac))
        eta = (time.time() - self.start) / frac * (1 - frac)
        sys.stderr.write(f"\r{self.label} [{bar}] {self.done}/{self.total} "
                         f"eta {eta:4.0f}s {what[:40]:<40}")
        sys.stderr.flush()

    def close(self) -> None:
        if self.enabled:
            sys.stderr.write("\n")
            sys.stderr.flush()
