"""How long a ``tkit bench`` run will take, printed (as an estimate) before it starts.

A case's wall time is mostly first-call work (Triton compiles, torch.compile of the baselines,
cuDNN/cuBLAS heuristics), then the timing itself (rounds x providers x the timing window).
With a warm-up (``--warm-jobs``), the first calls run before the timing in several processes
at once, so their share of the total is divided by the number of processes. Each finished case
records its timing pass's wall time in its rows (``case_seconds``) and its warm-up's
(``warm_seconds``); the next run on the same device reads them from the results files in the
output folder (the run files first, then the long-form ``<device>.jsonl``). Cases no earlier
run timed take their family's figure from :data:`FAMILY_SECONDS`.
"""

from __future__ import annotations

import json
from pathlib import Path

#: seconds a case, by family, at the default 3 rounds of 100 ms; derived in docs/NOTES.md
#: ("tkit bench: wall time a case") from an H200 `tkit bench --quick` run (20 cases in 153 s,
#: first calls included) and from the first-call time of a new attention variant
FAMILY_SECONDS = {"elementwise": 7.5, "reductions": 7.5, "matmul": 7.5, "attention": 16.0,
                  "cuda_ext": 7.5}
DEFAULT_SECONDS = 7.5
#: the timing part of a case, per provider and round: do_bench's warm-up (25 ms) and its
#: window, and as much again for its own calibration and L2 flushes
_TIMING_OVERHEAD = 2.0


def previous_timings(out_dir: str | Path, device: str) -> tuple[dict, list[Path]]:
    """{(op, case): (case seconds, warm-up seconds or None)} from the results files in
    ``out_dir`` written on ``device`` whose rows carry case wall times, the newest file's time
    where several have a case; and the files that gave one."""
    files = sorted(Path(out_dir).glob("*.json"), key=lambda p: p.stat().st_mtime, reverse=True)
    times: dict = {}
    used: list[Path] = []
    for path in files:
        try:
            data = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        if not isinstance(data, dict) or (data.get("environment") or {}).get("device") != device:
            continue
        n = len(times)
        for r in data.get("rows", []):
            if isinstance(r, dict) and r.get("case_seconds") is not None:
                times.setdefault((r["op"], r["case"]), (r["case_seconds"],
                                                        r.get("warm_seconds")))
        if len(times) > n:
            used.append(path)
    # then the long-form rows (``<device>.jsonl``, committed with the repository: a fresh
    # clone's first run reads the case times measured where the repository was made), the
    # last row of a case in file order being its newest
    for path in sorted(Path(out_dir).glob("*.jsonl")):
        found: dict = {}
        try:
            lines = path.read_text().splitlines()
        except OSError:
            continue
        for line in lines:
            try:
                r = json.loads(line)
            except ValueError:
                continue
            if (isinstance(r, dict) and r.get("device") == device
                    and r.get("case_seconds") is not None
                    and (r.get("op"), r.get("case")) not in times):
                found[(r["op"], r["case"])] = (r["case_seconds"], r.get("warm_seconds"))
        if found:
            times.update(found)
            used.append(path)
    return times, used


def case_seconds(family: str, rounds: int = 3, rep_ms: int = 100, providers: int = 3) -> float:
    """The table's figure for one case, scaled for rounds and timing windows other than the
    defaults (3 rounds, 100 ms, three providers)."""
    base = FAMILY_SECONDS.get(family, DEFAULT_SECONDS)
    timing = lambda r, ms: r * providers * (25 + ms) * _TIMING_OVERHEAD / 1e3
    return max(1.0, base - timing(3, 100) + timing(rounds, rep_ms))


def estimate(planned, out_dir, device: str, rounds: int = 3, rep_ms: int = 100,
             warm_jobs: int = 0) -> dict:
    """{"seconds": total, "per_case": [...], "timed": cases timed by an earlier run,
    "sources": those runs' files}. ``planned``: (op name, family, case label) triples;
    ``warm_jobs``: the processes of the warm-up (0: none)."""
    previous, sources = previous_timings(out_dir, device)
    per_case, timed = [], 0
    timing = 1.0 + rounds * 3 * (25 + rep_ms) * _TIMING_OVERHEAD / 1e3
    for op, family, label in planned:
        if (op, label) in previous:
            seconds, warm = previous[(op, label)]
            timed += 1
        else:
            seconds, warm = case_seconds(family, rounds, rep_ms), None
        seconds = float(seconds)
        if warm is None and warm_jobs:  # a run without warm-up: its first calls were timed
            warm, seconds = max(0.0, seconds - timing), min(seconds, timing)
        if warm is not None:
            seconds += float(warm) / warm_jobs if warm_jobs else float(warm)
        per_case.append(seconds)
    return {"seconds": sum(per_case), "per_case": per_case, "timed": timed,
            "sources": sources if timed else []}


def describe(est: dict, n_cases: int) -> str:
    """One line for the start of a run."""
    total = est["seconds"]
    when = f"{total / 60:.0f} min" if total >= 90 else f"{total:.0f} s"
    parts = []
    if est["timed"]:
        files = est["sources"]
        where = str(files[0]) if len(files) == 1 else f"{len(files)} files in {files[0].parent}"
        parts.append(f"{est['timed']} timed by earlier runs ({where})")
    if n_cases - est["timed"]:
        parts.append(f"{n_cases - est['timed']} from the per-family table in "
                     f"tkit/bench/estimate.py")
    return f"{n_cases} cases, estimated wall time ~{when} (an estimate: {'; '.join(parts)})"
