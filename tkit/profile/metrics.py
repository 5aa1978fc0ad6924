"""The Nsight Compute metrics ``tkit profile`` collects, and the parser of ``ncu --csv --page
raw`` output (a header row of column names, a row of units, then a row a profiled kernel)."""

from __future__ import annotations

import csv
import io

#: short name -> ncu metric (Hopper names; all of them are in ncu's default set of sections)
METRICS = {
    "duration_ns": "gpu__time_duration.sum",
    "dram_pct": "dram__throughput.avg.pct_of_peak_sustained_elapsed",
    "sm_pct": "sm__throughput.avg.pct_of_peak_sustained_elapsed",
    "l2_hit_pct": "lts__t_sector_hit_rate.pct",
    "occupancy_pct": "sm__warps_active.avg.pct_of_peak_sustained_active",
    "occupancy_limit_pct": "sm__maximum_warps_per_active_cycle_pct",
    "tensor_pct": "sm__pipe_tensor_op_hmma_cycles_active.avg.pct_of_peak_sustained_active",
    "gmma_pct": "sm__pipe_tensor_op_gmma_cycles_active.avg.pct_of_peak_sustained_active",
    "fma_pct": "sm__pipe_fma_cycles_active.avg.pct_of_peak_sustained_active",
    "registers": "launch__registers_per_thread",
    "grid": "launch__grid_size",
    "block": "launch__block_size",
    "sms": "device__attribute_multiprocessor_count",
    "shared_bytes": "launch__shared_mem_per_block",
    "dram_bytes": "dram__bytes.sum",
}

#: why warps did not issue: short name -> ncu's stall reason in the metric's name
STALLS = ("long_scoreboard", "short_scoreboard", "barrier", "membar", "mio_throttle",
          "lg_throttle", "tex_throttle", "math_pipe_throttle", "wait", "not_selected",
          "no_instruction", "branch_resolving", "dispatch_stall", "drain", "sleeping",
          "imc_miss", "selected")


def stall_metric(reason: str) -> str:
    return f"smsp__average_warps_issue_stalled_{reason}_per_issue_active.ratio"


def all_metrics() -> list[str]:
    return list(METRICS.values()) + [stall_metric(r) for r in STALLS]


def _number(text: str):
    t = text.strip().replace(",", "")
    if not t or t.lower() in ("n/a", "nan"):
        return None
    try:
        return float(t)
    except ValueError:
        return None


def parse_raw_csv(text: str) -> list[dict]:
    """Kernels of ``ncu --csv --page raw`` output: one dict a row, ``kernel`` (the name),
    ``id``, the short names of :data:`METRICS` and ``stalls`` ({reason: warps a issued
    instruction}); a metric ncu did not report is absent. Lines before the CSV header (the
    profiled program's own output, ``==PROF==`` lines) are skipped."""
    lines = text.splitlines()
    start = next((i for i, ln in enumerate(lines)
                  if ln.startswith('"ID"') and "Kernel Name" in ln), None)
    if start is None:
        raise ValueError("no ncu raw CSV header (a line starting \"ID\" with \"Kernel Name\") "
                         "in the output")
    rows = list(csv.reader(io.StringIO("\n".join(lines[start:]))))
    header = rows[0]
    body = [r for r in rows[1:] if len(r) == len(header)]
    # the units row: no ID
    body = [r for r in body if r[header.index("ID")].strip()]
    short = {v: k for k, v in METRICS.items()}
    stall_names = {stall_metric(r): r for r in STALLS}
    out = []
    for r in body:
        row = {"id": int(_number(r[header.index("ID")]) or 0),
               "kernel": r[header.index("Kernel Name")], "stalls": {}}
        for name, value in zip(header, r):
            if name in short:
                v = _number(value)
                if v is not None:
                    row[short[name]] = v
            elif name in stall_names:
                v = _number(value)
                if v is not None:
                    row["stalls"][stall_names[name]] = v
        out.append(row)
    return out
