"""Tables (terminal and markdown), long-form JSON rows, and the roofline plot.

Every ``tkit bench`` run writes its own ``<stem>.json`` / ``.md`` (/ ``.png``) and appends its
rows to the device's long-form file ``<out>/<device>.jsonl`` (one JSON object a line: run, date,
device, op, case, provider, median_ms, p20_ms, p80_ms, the row's other fields, versions and git
sha); records that time nothing (sanitizer, fuzz, checks) go to ``<out>/<device>-checks.jsonl``.
Only the long-form files are kept: the per-run files are not committed. ``<out>/README.md`` is
generated from the long-form files::

    python -m tkit.bench.report --readme [--out benchmarks/results]
    python -m tkit.bench.report --convert RUN.json ...   # older per-run files, once
"""

from __future__ import annotations

import json
import re
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


def missing_baselines(rows: list[dict]) -> dict[str, list[str]]:
    """Each op's declared baselines that have no row in ``rows`` (their factories returned
    None here: a library not installed, or a probe that failed), by op."""
    from tkit import registry

    seen: dict[str, set] = {}
    for r in rows:
        seen.setdefault(r["op"], set()).add(r["provider"])
    out = {}
    for op, providers in seen.items():
        try:
            declared = registry.get(op).baselines
        except KeyError:  # rows of a spec no longer registered
            continue
        if missing := [name for name in declared if name not in providers]:
            out[op] = missing
    return out


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
    append_long_form(rows, out_dir, env, run=stem)
    return jpath, mpath


# ---- the long-form files: one per device, a row a line ----------------------------------------
#: the leading fields of a long-form row, in this order; the row's other fields follow
LONG_FIELDS = ("run", "date", "device", "op", "case", "provider", "median_ms", "p20_ms", "p80_ms")
#: environment fields stamped on every long-form row
ENV_FIELDS = ("device", "date", "git_sha", "torch", "triton", "cuda", "python", "sm", "sms")


def device_slug(device: str) -> str:
    """The long-form file's name for a device: ``NVIDIA H200`` -> ``h200``."""
    slug = "".join(c if c.isalnum() else "-" for c in (device or "device")).lower()
    slug = re.sub("-+", "-", slug).strip("-")
    return slug.removeprefix("nvidia-") or "device"


def long_rows(rows: list[dict], env: dict, run: str, source: str = "tkit bench") -> list[dict]:
    """``rows`` as long-form rows: the leading fields first, then the rest; the environment's
    device, versions, git sha and date fill what a row lacks."""
    out = []
    for r in rows:
        merged = {**{k: env[k] for k in ENV_FIELDS if env.get(k) is not None}, **r}
        merged.update(run=run, source=merged.get("source", source))
        line = {k: merged.get(k) for k in LONG_FIELDS}
        line.update((k, v) for k, v in merged.items() if k not in line)
        out.append(line)
    return out


def long_form_path(out_dir: str | Path, device: str) -> Path:
    return Path(out_dir) / f"{device_slug(device)}.jsonl"


def append_long_form(rows: list[dict], out_dir: str | Path, env: dict | None, run: str,
                     source: str = "tkit bench") -> Path:
    """Append ``rows`` to ``<out_dir>/<device>.jsonl`` under the run id ``run``; the lines of an
    earlier run with the same id are replaced (a rerun with the same stem also overwrites its
    ``.json``)."""
    env = env or {}
    device = env.get("device") or next((r.get("device") for r in rows if r.get("device")), "")
    path = long_form_path(out_dir, device)
    path.parent.mkdir(parents=True, exist_ok=True)
    kept = [ln for ln in read_long_form(path) if ln.get("run") != run] if path.exists() else None
    new = long_rows(rows, env, run, source)
    if kept is not None and len(kept) != sum(1 for _ in _lines(path)):
        path.write_text("".join(json.dumps(ln, default=str) + "\n" for ln in kept + new))
    else:
        with path.open("a") as f:
            f.writelines(json.dumps(ln, default=str) + "\n" for ln in new)
    return path


def _lines(path: Path):
    with path.open() as f:
        yield from (ln for ln in f if ln.strip())


def read_long_form(path: str | Path) -> list[dict]:
    """The rows of one long-form file, in the order they were appended."""
    return [json.loads(ln) for ln in _lines(Path(path))]


def latest(rows: list[dict]) -> list[dict]:
    """The latest row per (op, case, provider): the last appended, the newest date winning;
    sorted by op, then in the order the (op, case, provider) first appeared."""
    best: OrderedDict = OrderedDict()
    for i, r in enumerate(rows):
        key = (r.get("op"), r.get("case"), r.get("provider"))
        if key not in best:
            best[key] = (i, r)
        elif (r.get("date") or "") >= (best[key][1].get("date") or ""):
            best[key] = (best[key][0], r)
    return [r for _, r in sorted(best.values(), key=lambda t: (str(t[1].get("op")),
                                                                 t[0]))]


def _rate(r: dict) -> str:
    if r.get("median_ms") is None:
        return "-"
    if r.get("bound") == "compute" or (r.get("tflops") and not r.get("tbps")):
        return f"{r['tflops']:.1f} TFLOP/s" if r.get("tflops") else "-"
    return f"{r['tbps']:.2f} TB/s" if r.get("tbps") else "-"


def readme_text(out_dir: str | Path) -> str:
    """benchmarks/results/README.md: per device, the latest ``tkit bench`` figure of every
    (op, case, provider) in its long-form file, with the run that measured it."""
    out_dir = Path(out_dir)
    md = ["# Benchmark results", "",
          "Generated by `python -m tkit.bench.report --readme` from the long-form files in this "
          "folder, one per device: `<device>.jsonl`, the timings (one JSON row a line: run, "
          "date, device, op, case, provider, median/p20/p80 ms, the other fields of the row, "
          "versions, git sha), and `<device>-checks.jsonl`, the records that time nothing "
          "(compute-sanitizer and fuzz results, the probe scripts' correctness checks and "
          "skipped configurations; same leading fields, `part` / `status` "
          "/ `ok` saying what each is). A row's `run` is the run id "
          "(`<device>-<date>-<letter>-<what>`). `tkit bench` appends its rows to its device's "
          "file; the per-run `<run>.json` / `.md` / `.png` it also writes and the raw logs of a "
          "run are not committed (git history keeps the ones that were). Edit nothing here by "
          "hand: the history of the runs, what each measured and why, is in [RUNS.md](RUNS.md) "
          "and docs/NOTES.md, which name runs by their id.", "",
          "Below: the latest `tkit bench` row of each op, case and provider (median ms; TB/s or "
          "TFLOP/s at that median; p20-p80 in ms), timed by CUDA events. Rows converted from "
          "the probe scripts' files (`source` other than `tkit bench`) and rows timed by their "
          "kernels (`timer` `kernels`) stay in the long-form file and are counted at the end of "
          "each device's section, and so are the runs of its checks file.", ""]
    for path in sorted(out_dir.glob("*.jsonl")):
        if re.search(r"\d{4}-\d{2}-\d{2}", path.stem) or path.stem.endswith(CHECKS_SUFFIX):
            continue  # a run's own JSON-lines file (not kept), or a device's checks file
        rows = [r for r in read_long_form(path) if isinstance(r, dict) and "run" in r]
        if not rows or "provider" not in rows[0]:
            continue
        # the newest row that names its device (a probe's rows may not)
        device = next((r["device"] for r in reversed(rows) if r.get("device")), path.stem)
        # the tables hold event-timed rows alone: a kernel-timed row (``tkit bench --timer
        # kernels``) leaves out what a stream spends around a run, and is counted below
        def tabled(r):
            return (r.get("source", "tkit bench") == "tkit bench"
                    and r.get("timer", "events") == "events")

        bench = [r for r in rows if tabled(r)]
        ceils = [r for r in rows if r.get("op") == "ceilings"]
        others = [r for r in rows if r.get("op") != "ceilings" and not tabled(r)]
        md += [f"## {device} (`{path.name}`)", ""]
        if ceils:
            c = ceils[-1]
            md += [f"Ceilings (rows with op `ceilings`, {len(ceils)} runs): latest copy "
                   f"{c.get('copy_tbps')} TB/s (bytes read + written), bf16 matmul "
                   f"{c.get('bf16_tflops')} TFLOP/s, run `{c['run']}` ({c.get('date')}).", ""]
        if bench:
            md += ["| op | case | group | provider | ms | p20-p80 ms | rate | ok | date | run "
                   "| git |", "|---|---|---|---|---|---|---|---|---|---|---|"]
            for r in latest(bench):
                spread = (f"{r['p20_ms']:.4g}-{r['p80_ms']:.4g}"
                          if r.get("p20_ms") is not None and r.get("p80_ms") is not None
                          else "-")
                ok = {True: "yes", False: "NO"}.get(r.get("ok"), "-")
                md.append(f"| {r.get('op')} | {r.get('case')} | {r.get('group') or '-'} | "
                          f"{r.get('provider')} | "
                          f"{_fmt(r.get('median_ms'), '.4g')} | {spread} | {_rate(r)} | {ok} | "
                          f"{r.get('date') or '-'} | {r['run']} | {r.get('git_sha') or '-'} |")
            md.append("")
        if others:
            runs: OrderedDict = OrderedDict()
            for r in others:
                runs.setdefault(r["run"], [r.get("source"), 0])[1] += 1
            md += [f"{len(others)} rows from {len(runs)} runs of probe scripts, other "
                   "benchmarks and kernel timers (`source`, `timer` in the file): "
                   + ", ".join(f"`{run}` ({n})" for run, (_, n) in runs.items()) + ".", ""]
        md += _checks_lines(path.with_name(path.stem + CHECKS_SUFFIX + ".jsonl"))
    return "\n".join(md)


#: the stem suffix of a device's second long-form file: the records that time nothing
CHECKS_SUFFIX = "-checks"


def checks_path(out_dir: str | Path, device: str) -> Path:
    """``<out_dir>/<device>-checks.jsonl``: sanitizer, fuzz and correctness records."""
    return Path(out_dir) / f"{device_slug(device)}{CHECKS_SUFFIX}.jsonl"


def _check_label(r: dict) -> str:
    ok = {True: "ok", False: "NOT ok"}.get(r.get("ok"), "")
    return " ".join(str(x) for x in (r.get("part"), r.get("status"), ok) if x) or "record"


def _checks_lines(path: Path) -> list[str]:
    """The README's lines for a device's checks file: each run, its records counted by
    part / status / ok."""
    if not path.exists():
        return []
    runs: OrderedDict = OrderedDict()
    for r in read_long_form(path):
        labels = runs.setdefault((r.get("run"), r.get("source")), OrderedDict())
        labels[_check_label(r)] = labels.get(_check_label(r), 0) + 1
    md = [f"Checks (`{path.name}`, the records that time nothing):", ""]
    for (run, source), labels in runs.items():
        md.append(f"- `{run}` ({source}): {sum(labels.values())} records: "
                  + ", ".join(f"{lab} {n}" for lab, n in labels.items()))
    return md + [""]


def write_readme(out_dir: str | Path) -> Path:
    path = Path(out_dir) / "README.md"
    path.write_text(readme_text(out_dir))
    return path


# ---- converting the per-run files written before the long-form files --------------------------
_TIME_KEYS = {"median_ms": ("median_ms", "ms"), "p20_ms": ("p20_ms", "p20"),
              "p80_ms": ("p80_ms", "p80")}
_NOT_CASE = {"op", "provider", "name", "note", "ok", "error", "err", "rel_err", "tflops", "tbs",
             "tbps", "pct", "pct_ceiling", "pct_of_gemm", "seconds", "t", "bytes", "check_ok",
             "best_base_tbs", "vs_baseline", "vs_compile", "ratio_cublas", "round", "step",
             "phase", "kind", "metric", "max_abs_err_vs_sdpa_flash"}


def _script_rows(data: dict, what: str) -> list[dict]:
    """Timed rows of a probe script's results file, in long form: provider and times found
    under the names the scripts used; the other scalar fields name the case."""
    out = []
    for r in data.get("rows", []):
        if not isinstance(r, dict):
            continue
        expanded = []
        for key in ("providers", "graph"):  # {provider: {median_ms, tbs, ...}}
            for prov, v in (r.get(key) or {}).items() if isinstance(r.get(key), dict) else ():
                if isinstance(v, dict) and v.get("median_ms") is not None:
                    expanded.append({**v, "provider": prov,
                                     "timing": "cuda graph" if key == "graph" else "events"})
        for k, v in r.items():  # {provider}_us: host time per call
            if k.endswith("_us") and isinstance(v, (int, float)):
                expanded.append({"provider": k[:-3], "median_ms": v / 1e3, "timing": "host"})
        base = {k: v for k, v in r.items()
                if not isinstance(v, (dict, list)) and not k.endswith("_us")}
        if isinstance(r.get("config"), dict):
            base["config"] = " ".join(f"{k}={v}" for k, v in r["config"].items())
        for sub in expanded or [{}]:
            row = {**base, **{k: v for k, v in sub.items() if not isinstance(v, (dict, list))}}
            times = {k: next((row.pop(n) for n in names if row.get(n) is not None), None)
                     for k, names in _TIME_KEYS.items()}
            for names in _TIME_KEYS.values():
                for n in names:
                    row.pop(n, None)
            if times["median_ms"] is None:
                continue  # a configuration or check row: nothing timed
            if "tbs" in row:
                row["tbps"] = row.pop("tbs")
            provider = row.pop("provider", None) or row.pop("name", None) or "tkit"
            op = row.pop("op", None) or what
            case = row.pop("case", None)
            parts = [str(row[k]) for k in ("section", "shape")
                     if row.get(k) not in (None, "") and str(row[k]) not in str(case or "")]
            parts += [f"{k}={v}" for k, v in row.items()  # floats are results, not the case
                      if k not in _NOT_CASE and k not in ("section", "shape", "timing")
                      and v not in (None, "") and not isinstance(v, float)
                      and f"{k}={v}" not in str(case or "")]
            if row.get("timing"):
                parts.append(row["timing"])
            case = " ".join(([str(case)] if case else []) + parts) or "-"
            out.append({"op": op, "case": case, "provider": provider, **times, **row})
    return out


def convert_run_file(path: str | Path) -> tuple[list[dict], dict]:
    """(long-form rows, environment) of one per-run results file with "rows": a ``tkit bench``
    file as it is, a probe script's file through :func:`_script_rows`."""
    path = Path(path)
    data = json.loads(path.read_text())
    m = re.match(r"(?P<dev>.+?)-(?P<date>\d{4}-\d{2}-\d{2})-(?P<run>[a-z]+)-(?P<what>.+)",
                 path.stem)
    env = dict(data.get("environment") or {})
    if env.get("device"):  # written by tkit bench
        return long_rows(data["rows"], env, path.stem), env
    meta = data.get("meta") or {}
    env.update({k: meta[k] for k in ENV_FIELDS if meta.get(k)})
    if m:
        env.setdefault("date", m["date"])
        env.setdefault("device", "NVIDIA " + m["dev"].upper() if m["dev"] == "h200"
                       else m["dev"])
    what = m["what"] if m else path.stem
    rows = _script_rows(data, what)
    return long_rows(rows, env, path.stem, source=f"script ({what})"), env


def convert(paths, out_dir: str | Path) -> dict[Path, int]:
    """Append the rows of older per-run files (oldest first: sorted by name) to the long-form
    files in ``out_dir``; {long-form file: rows appended}."""
    counts: dict[Path, int] = {}
    for path in sorted(Path(p) for p in paths):
        data = json.loads(path.read_text())
        if not isinstance(data, dict) or "rows" not in data:
            continue
        rows, env = convert_run_file(path)
        if not rows:
            continue
        dest = append_long_form(rows, out_dir, env, run=path.stem,
                                source=rows[0].get("source", "tkit bench"))
        counts[dest] = counts.get(dest, 0) + len(rows)
    return counts


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


def main(argv=None) -> int:
    import argparse

    ap = argparse.ArgumentParser(prog="python -m tkit.bench.report",
                                 description="the long-form results files and their README")
    ap.add_argument("--out", default="benchmarks/results", help="the results folder")
    ap.add_argument("--readme", action="store_true", help="write <out>/README.md")
    ap.add_argument("--convert", nargs="+", metavar="RUN.json",
                    help="append older per-run files' rows to the long-form files")
    args = ap.parse_args(argv)
    if not (args.readme or args.convert):
        ap.error("nothing to do: --readme and/or --convert FILES")
    for dest, n in (convert(args.convert, args.out) if args.convert else {}).items():
        print(f"appended {n} rows to {dest}")
    if args.readme:
        print(f"wrote {write_readme(args.out)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
