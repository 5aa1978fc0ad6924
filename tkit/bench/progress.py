"""Progress of a ``tkit bench`` run: a live bar on a terminal (tqdm), and one line per finished
case (op, case, tkit's figure and % of roofline, the best baseline, the ratio) on stdout, so
that a log or a pipe shows the run advancing too."""

from __future__ import annotations

import sys
import time


class Reporter:
    """``begin(what)`` when a case starts, ``done(rows)`` when it has its rows."""

    def __init__(self, total: int, label: str = "bench", bar: bool | None = None,
                 lines: bool = True, out=None):
        self.total, self.label, self.count = total, label, 0
        self.out = out or sys.stdout
        self.lines = lines
        self.start = time.time()
        self._bar = None
        if bar is None:
            bar = sys.stderr.isatty()
        if bar and total:
            try:
                from tqdm import tqdm
            except ImportError:  # a copy of the tree run without installing it: lines only
                tqdm = None
            if tqdm is not None:
                self._bar = tqdm(total=total, desc=label, unit="case", file=sys.stderr,
                                 dynamic_ncols=True, leave=True)

    def begin(self, what: str) -> None:
        if self._bar is not None:
            self._bar.set_postfix_str(what[:60], refresh=True)

    def done(self, rows: list[dict], check: bool = False) -> None:
        from tkit.bench.report import case_line, check_line

        self.count += 1
        if self.lines:
            line = (check_line if check else case_line)(rows)
            line = f"[{self.count}/{self.total} {time.time() - self.start:5.0f} s] {line}"
            if self._bar is not None:
                self._bar.write(line, file=self.out)
            else:
                print(line, file=self.out, flush=True)
        if self._bar is not None:
            self._bar.update(1)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None
