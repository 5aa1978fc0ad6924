"""Tables (terminal and markdown), long-form JSON rows, and the roofline plot."""

from __future__ import annotations

import json
from collections import OrderedDict
from pathlib import Path


def _fmt(x, spec=".3g"):
    if x is None:
        return "-"
    if isinstance(x, float):
        return format(x, spec)
    return str(x)


def summary(rows: list[dict]) -> list[dict]:
    """One line per (op, case): tkit's figures and its speed-up over each baseline
    (baseline time / tkit time: above 1 means tkit is faster)."""
    groups: OrderedDict = OrderedDict()
    for r in rows:
        groups.setdefault((r["op"], r["case"]), []).append(r)
    out = []
    for (op, case), rs in groups.items():
        mine = next((r for r in rs if r["provider"] == "tkit"), None)
        if mine is None:
            continue
        line = {
            "op": op, "case": case, "group": mine["group"], "ok": mine["ok"],
            "ms": mine["median_ms"], "TB/s": mine["tbps"], "TFLOP/s": mine["tflops"],
            "% roofline": mine["pct_of_roofline"], "bound": mine["bound"], "note": mine["note"],
            "vs": {},
        }
        for r in rs:
            if r["provider"] == "tkit":
                continue
            if r["median_ms"] and mine["median_ms"]:
                line["vs"][r["provider"]] = r["median_ms"] / mine["median_ms"]
            else:
                line["vs"][r["provider"]] = None
        out.append(line)
    return out


def case_line(rows: list[dict]) -> str:
    """One finished case in a line: tkit's figure (TFLOP/s for compute-bound ops, TB/s for the
    rest) and % of roofline, the fastest baseline and tkit's speed-up over it."""
    mine = next((r for r in rows if r["provider"] == "tkit"), rows[0])
    head = f"{mine['op']} {mine['case']}:"
    secs = f" ({mine['case_seconds']:.0f} s)" if mine.get("case_seconds") is not None else ""
    if not mine["median_ms"]:
        return f"{head} FAILED {mine['note'][:300]}{secs}"

    def figure(r):
        if r["bound"] == "compute":
            return f"{r['tflops']:.1f} TFLOP/s"
        return f"{r['tbps']:.2f} TB/s"

    text = f"{head} tkit {figure(mine)}"
    if mine["pct_of_roofline"] is not None:
        text += f" ({mine['pct_of_roofline']:.0f}% of roofline)"
    if not mine["ok"]:
        text += f" WRONG: {mine['note'][:200]}"
    others = [r for r in rows if r["provider"] != "tkit" and r["median_ms"]]
    if others:
        best = min(others, key=lambda r: r["median_ms"])
        text += (f"; best baseline {best['provider']} {figure(best)}, "
                 f"x{best['median_ms'] / mine['median_ms']:.2f}")
    return text + secs


def check_line(rows: list[dict]) -> str:
    """One checked case in a line (machines without a GPU)."""
    r = rows[0]
    verdict = "ok" if r["ok"] else f"FAILED {r['note']}"
    return f"{r['op']} {r['case']}: {verdict} ({r['seconds']:.1f} s)"


def _baseline_names(lines):
    names: list[str] = []
    for ln in lines:
        for k in ln["vs"]:
            if k not in names:
                names.append(k)
    return names


def _table(lines, sep="  ", markdown=False) -> str:
    names = _baseline_names(lines)
    head = ["op", "case", "ms", "TB/s", "TFLOP/s", "% roofline"] + [f"x {n}" for n in names]
    head.append("ok")
    body = []
    for ln in lines:
        cells = [ln["op"], ln["case"], _fmt(ln["ms"], ".4f"), _fmt(ln["TB/s"], ".2f"),
                 _fmt(ln["TFLOP/s"], ".1f"), _fmt(ln["% roofline"], ".1f")]
        cells += [_fmt(ln["vs"].get(n), ".2f") for n in names]
        cells.append("yes" if ln["ok"] else f"NO {ln['note'][:100]}")
        body.append(cells)
    if markdown:
        lines_ = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
        lines_ += ["| " + " | ".join(c) + " |" for c in body]
        return "\n".join(lines_)
    widths = [max(len(str(x)) for x in col) for col in zip(head, *body)]
    fmt = lambda cells: sep.join(str(c).ljust(w) for c, w in zip(cells, widths))
    return "\n".join([fmt(head), fmt(["-" * w for w in widths])] + [fmt(c) for c in body])


def terminal_table(rows: list[dict]) -> str:
    return _table(summary(rows))


def check_table(rows: list[dict], markdown: bool = False) -> str:
    head = ["op", "case", "ok", "seconds", "note"]
    body = [[r["op"], r["case"], "yes" if r["ok"] else "NO", _fmt(r["seconds"]), r["note"]]
            for r in rows]
    if markdown:
        return "\n".join(["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
                         + ["| " + " | ".join(map(str, c)) + " |" for c in body])
    widths = [max(len(str(x)) for x in col) for col in zip(head, *body)]
    fmt = lambda cells: "  ".join(str(c).ljust(w) for c, w in zip(cells, widths))
    return "\n".join([fmt(head), fmt(["-" * w for w in widths])] + [fmt(c) for c in body])


def write_results(rows: list[dict], out_dir: str | Path, ceilings=None, env=None,
                  stem: str | None = None) -> tuple[Path, Path]:
    """Write ``<stem>.json`` (long-form rows) and ``<stem>.md`` (readable tables)."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    env = env or {}
    if stem is None:
        dev = "".join(c if c.isalnum() else "-" for c in env.get("device", "device")).lower()
        stem = f"{dev.strip('-')}-{env.get('date', 'today')}"
    jpath, mpath = out_dir / f"{stem}.json", out_dir / f"{stem}.md"
    jpath.write_text(json.dumps({"environment": env,
                                 "ceilings": ceilings.__dict__ if ceilings else None,
                                 "rows": rows}, indent=1, default=str))
    lines = summary(rows)
    md = [f"# tkit benchmark: {env.get('device', '?')}, {env.get('date', '?')}", ""]
    md.append(f"torch {env.get('torch')}, triton {env.get('triton')}, CUDA {env.get('cuda')}, "
              f"git {env.get('git_sha')}.")
    if ceilings:
        md.append(f"Ceilings measured in the same run: copy {ceilings.copy_tbps:.2f} TB/s "
                  f"(bytes read + written), bf16 matmul {ceilings.bf16_tflops:.0f} TFLOP/s.")
    md += ["", "Times are medians of CUDA-event timings with L2 flushed, baselines interleaved; "
           "`x NAME` is NAME's time over tkit's (above 1: tkit is faster); `% roofline` is the "
           "roofline's least time over the measured time.", ""]
    families: OrderedDict = OrderedDict()
    fam_of = {(r["op"], r["case"]): r["family"] for r in rows}
    for ln in lines:
        families.setdefault(fam_of[(ln["op"], ln["case"])], []).append(ln)
    for fam, lns in families.items():
        md += [f"## {fam}", "", _table(lns, markdown=True), ""]
    mpath.write_text("\n".join(md))
    return jpath, mpath


def plot_roofline(rows: list[dict], ceilings, path: str | Path) -> Path | None:
    """Every measured tkit case on the device's roofline (log-log), as a PNG."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("--plot needs matplotlib (pip install 'tkit[plot]')")
        return None
    pts = [r for r in rows if r["provider"] == "tkit" and r["median_ms"] and r["bytes"]]
    fig, ax = plt.subplots(figsize=(9, 6))
    xs = [10 ** (i / 20) for i in range(-40, 100)]
    bw, peak = ceilings.copy_tbps, ceilings.bf16_tflops
    ax.plot(xs, [min(peak, bw * x) for x in xs], "k-", lw=1.5,
            label=f"roofline: {bw:.2f} TB/s, {peak:.0f} TFLOP/s bf16")
    fams = sorted({r["family"] for r in pts})
    for fam in fams:
        fr = [r for r in pts if r["family"] == fam]
        ai = [max(r["flops"], 1.0) / r["bytes"] for r in fr]
        perf = [max(r["flops"], 1.0) / (r["median_ms"] * 1e-3) / 1e12 for r in fr]
        ax.scatter(ai, perf, label=fam, s=25)
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("arithmetic intensity (FLOP / byte of HBM traffic)")
    ax.set_ylabel("TFLOP/s")
    ax.set_title(f"tkit on {pts[0]['device'] if pts else '?'}")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
