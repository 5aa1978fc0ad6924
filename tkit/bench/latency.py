"""Host latency: wall time per eager call at decode sizes, tkit beside torch, and both under
CUDA-graph replay.

At decode sizes a kernel runs for a few microseconds, so an eager call costs whatever the host
spends launching it. Each figure is the wall clock of ``calls`` back-to-back calls divided by
``calls`` (synchronized before and after), as a median over ``rounds`` bursts with the 20th and
80th percentiles. Providers:

* ``tkit``, ``torch`` (eager; F.rms_norm, F.linear, SDPA ...), ``torch.compile`` (the torch
  function compiled, default mode: what a user would write; skipped with a note if it fails);
* ``tkit+graph``, ``torch+graph``: the same call captured ``GRAPH_CALLS`` times in one CUDA
  graph, replayed; the time per call is the GPU time plus a share of one replay launch.

Rows are the long-form rows of :mod:`tkit.bench.report` with ``group`` = "latency", ``bound`` =
"host", the times in milliseconds and no bytes or FLOPs (the figure is not a throughput).

    tkit bench --group latency [--out DIR]      # or: python -m tkit.bench.latency
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

GRAPH_CALLS = 20


@dataclass
class LatencyCase:
    op: str
    family: str
    label: str
    make: Callable[[], tuple]  # inputs
    tkit: Callable
    torch: Callable
    compile_ok: bool = True
    meta: dict = field(default_factory=dict)


def decode_cases(device: str = "cuda", dtype=torch.bfloat16) -> list[LatencyCase]:
    """The calls of one decode step (bf16): one token of a Llama-3-8B-sized layer."""
    import torch.nn.functional as F

    import tkit

    def r(*shape):
        return torch.randn(*shape, device=device, dtype=dtype)

    def sdpa(q, k, v):
        # (B, S, H, D) -> SDPA's (B, H, S, D); GQA through enable_gqa
        return F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2),
                                              v.transpose(1, 2), enable_gqa=True).transpose(1, 2)

    return [
        LatencyCase("add", "elementwise", "(1, 4096)", lambda: (r(1, 4096), r(1, 4096)),
                    tkit.add, torch.add),
        LatencyCase("rms_norm", "norm", "(1, 4096)", lambda: (r(1, 4096), r(4096)),
                    lambda x, w: tkit.rms_norm(x, w, 1e-6),
                    lambda x, w: F.rms_norm(x, (x.shape[-1],), w, 1e-6)),
        LatencyCase("silu_mul", "elementwise", "(1, 14336)", lambda: (r(1, 14336), r(1, 14336)),
                    tkit.silu_mul, lambda a, b: F.silu(a) * b),
        LatencyCase("softmax", "softmax", "(1, 4096)", lambda: (r(1, 4096),),
                    tkit.softmax, lambda x: torch.softmax(x, -1)),
        LatencyCase("matmul", "matmul", "M=1, 4096x4096 (nn.Linear weight)",
                    lambda: (r(1, 4096), r(4096, 4096)),
                    lambda x, w: tkit.matmul(x, w.t()), F.linear),
        LatencyCase("matmul_int4", "matmul", "M=16, 4096x14336, g128 (torch: bf16 F.linear)",
                    lambda: _int4_inputs(r, 16, 4096, 14336),
                    lambda a, q, s, z, w: tkit.matmul_int4(a, q, s, z, group_size=128),
                    lambda a, q, s, z, w: F.linear(a, w)),
        LatencyCase("flash_attention", "attention", "q (1,1,32,128), 4096 keys, GQA 4",
                    lambda: (r(1, 1, 32, 128), r(1, 4096, 8, 128), r(1, 4096, 8, 128)),
                    tkit.flash_attention, sdpa),
        LatencyCase("decode_attention", "attention", "q (1,1,32,128), cache 4096, GQA 4",
                    lambda: (r(1, 1, 32, 128), r(1, 4096, 8, 128), r(1, 4096, 8, 128),
                             torch.full((1,), 4096, dtype=torch.int32, device=device)),
                    tkit.decode_attention, lambda q, k, v, lens: sdpa(q, k, v)),
    ]


def _int4_inputs(r, M: int, K: int, N: int) -> tuple:
    """(a, qweight, scales, zeros, w): a (M, K) and an INT4 weight of (N, K) quantized in groups
    of 128; ``w`` the bf16 weight it stands for (torch's F.linear takes that)."""
    import tkit

    q, s, z = tkit.quantize_int4(r(N, K), 128)
    w = tkit.dequantize_int4(q, s, z, group_size=128).contiguous()
    return r(M, K) * 0.05, q, s, z, w


def first_call_cases(device: str = "cuda") -> list[LatencyCase]:
    """The decode cases, and a variant no other case builds (head dim 96, softcap, a window):
    what a process pays the first time it meets a kernel."""
    import tkit

    def r(*shape):
        return torch.randn(*shape, device=device, dtype=torch.bfloat16)

    variant = LatencyCase(
        "flash_attention", "attention", "new variant: D=96, softcap 30, window (64, 0)",
        lambda: (r(1, 128, 16, 96), r(1, 128, 16, 96), r(1, 128, 16, 96)),
        lambda q, k, v: tkit.flash_attention(q, k, v, causal=True, softcap=30.0,
                                             window_size=(64, 0)),
        lambda q, k, v: torch.nn.functional.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)))
    # the INT4 case's first call is the CUDA kernel's build and self-test, once per machine
    return [c for c in decode_cases(device) if c.op != "matmul_int4"] + [variant]


def _first_calls_child(provider: str) -> None:
    """In a new process: for each first-call case, the wall time of its first call (inputs
    built and the CUDA context made beforehand), as JSON lines on stdout."""
    import json

    torch.zeros(1, device="cuda")
    torch.cuda.synchronize()
    if provider == "tkit":
        # tkit's families load on first use (``tkit.add`` imports the elementwise package,
        # Triton and its JIT functions): timed apart, as torch's ``import torch`` is not
        # part of its first call
        t0 = time.perf_counter()
        import tkit

        for name in sorted({c.op for c in first_call_cases("meta")}):
            getattr(tkit, name)
        print(json.dumps({"i": "import", "s": time.perf_counter() - t0}), flush=True)
    for i, case in enumerate(first_call_cases()):
        inputs = case.make()
        torch.cuda.synchronize()
        fn = case.tkit if provider == "tkit" else case.torch
        t0 = time.perf_counter()
        try:
            fn(*inputs)
            torch.cuda.synchronize()
            print(json.dumps({"i": i, "s": time.perf_counter() - t0}), flush=True)
        except Exception as e:  # noqa: BLE001 - the parent reports it
            print(json.dumps({"i": i, "error": f"{type(e).__name__}: {e}"[:200]}), flush=True)


def first_call_rows(env: dict, log=print) -> list[dict]:
    """First call of each case in a new process: tkit with an empty compile cache ("cold":
    Triton compiles), tkit again over the cache the cold run filled ("warm disk cache": what a
    restarted server pays), and torch's own first call in a new process."""
    import json
    import os
    import subprocess
    import sys
    import tempfile

    cases = first_call_cases("meta")
    rows = []
    with tempfile.TemporaryDirectory() as cache:
        for provider, label in (("tkit", "tkit cold"), ("tkit", "tkit warm cache"),
                                ("torch", "torch")):
            env_vars = {**os.environ, "TRITON_CACHE_DIR": os.path.join(cache, "triton"),
                        "TKIT_CACHE_DIR": os.path.join(cache, "tkit")}
            proc = subprocess.run([sys.executable, "-m", "tkit.bench.latency",
                                   "--first-calls-child", provider], env=env_vars,
                                  capture_output=True, text=True, timeout=600)
            got = {}
            for line in proc.stdout.splitlines():
                if line.startswith("{"):
                    d = json.loads(line)
                    got[d["i"]] = d
            for i, case in enumerate(cases):
                d = got.get(i, {"error": (proc.stderr.strip().splitlines() or ["no answer"])[-1]})
                t = (d["s"] * 1e3,) * 3 if "s" in d else None
                row = _row(case, label, t, env, ok=t is not None, note=d.get("error", ""))
                row["group"] = "first call"
                row["metric"] = "wall time of the first call in a new process"
                rows.append(row)
            if "import" in got:
                imp = LatencyCase("tkit", "import", "the first-call ops' modules loaded",
                                  tuple, None, None)
                t = (got["import"]["s"] * 1e3,) * 3
                row = _row(imp, label, t, env)
                row["group"] = "first call"
                row["metric"] = "wall time of loading the ops (tkit.<op> attribute access)"
                rows.append(row)
                log(f"first call, {label:16s} import of the ops' modules "
                    f"{got['import']['s'] * 1e3:.0f} ms (before the first calls)")
            log(f"first call, {label:16s} " + "  ".join(
                f"{c.op} {got[i]['s'] * 1e3:.0f} ms" if "s" in got.get(i, {}) else f"{c.op} -"
                for i, c in enumerate(cases)))
    return rows


def wall_per_call_ms(fn: Callable[[], object], calls: int, rounds: int, warmup: int = 50):
    """(median, p20, p80) over ``rounds`` bursts of wall time per call, in milliseconds (on a
    machine without CUDA, of the host's calls alone)."""
    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    for _ in range(warmup):
        fn()
    sync()
    per = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        sync()
        per.append((time.perf_counter() - t0) / calls * 1e3)
    per.sort()
    q = statistics.quantiles(per, n=10) if len(per) > 1 else per * 9
    return statistics.median(per), q[1], q[7]


def graph_of(fn: Callable[[], object], n: int = GRAPH_CALLS) -> Callable[[], object]:
    """``fn`` called ``n`` times, captured in one CUDA graph; returns a replay function that
    stands for ``n`` calls."""
    fn()
    torch.cuda.synchronize()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    g = torch.cuda.CUDAGraph()
    with torch.cuda.stream(s):
        fn()
        torch.cuda.synchronize()
        with torch.cuda.graph(g, stream=s):
            for _ in range(n):
                fn()
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    return g.replay


def _row(case: LatencyCase, provider: str, times, env: dict, ok=True, note="", calls=0):
    med, p20, p80 = times if times else (None, None, None)
    return {
        "op": case.op, "family": case.family, "case": case.label, "group": "latency",
        "provider": provider, "bound": "host", "ok": ok, "note": note,
        "bytes": None, "flops": None, "median_ms": med, "p20_ms": p20, "p80_ms": p80,
        "tbps": None, "tflops": None, "pct_of_roofline": None,
        "copy_tbps_ceiling": None, "bf16_tflops_ceiling": None,
        "metric": f"wall per call, {calls} back-to-back calls", **case.meta, **env,
    }


def run(calls: int = 2000, rounds: int = 7, compile: bool = True, graphs: bool = True,
        ops: list[str] | None = None, first_calls: bool = True, log=print) -> list[dict]:
    from tkit.bench.runner import environment

    env = environment()
    rows = []
    for case in decode_cases():
        if ops and case.op not in ops:
            continue
        inputs = case.make()
        ok, note = True, ""
        try:
            got, want = case.tkit(*inputs), case.torch(*inputs)
            torch.cuda.synchronize()
            if not torch.allclose(got.float(), want.float(), atol=5e-2, rtol=5e-2):
                ok, note = False, "tkit differs from torch"
        except Exception as e:  # noqa: BLE001 - a row says what failed, the run goes on
            ok, note = False, f"{type(e).__name__}: {str(e).splitlines()[0][:120]}"
        providers: list[tuple[str, Callable]] = [
            ("tkit", lambda c=case, x=inputs: c.tkit(*x)),
            ("torch", lambda c=case, x=inputs: c.torch(*x)),
        ]
        if compile and case.compile_ok:
            try:
                # a Python function around it: some torch functions are builtins
                compiled = torch.compile(lambda *x, f=case.torch: f(*x))
                compiled(*inputs)
                providers.append(("torch.compile", lambda f=compiled, x=inputs: f(*x)))
            except Exception as e:  # noqa: BLE001
                rows.append(_row(case, "torch.compile", None, env, ok=False,
                                 note=f"compile failed: {type(e).__name__}", calls=calls))
        for name, fn in providers:
            try:
                t = wall_per_call_ms(fn, calls, rounds)
                rows.append(_row(case, name, t, env, ok=ok if name == "tkit" else True,
                                 note=note if name == "tkit" else "", calls=calls))
            except Exception as e:  # noqa: BLE001
                rows.append(_row(case, name, None, env, ok=False,
                                 note=f"{type(e).__name__}: {str(e)[:100]}", calls=calls))
        if graphs:
            for name, fn in providers[:2]:
                try:
                    replay = graph_of(fn)
                    n = max(1, calls // GRAPH_CALLS)
                    med, p20, p80 = wall_per_call_ms(replay, n, rounds, warmup=5)
                    t = (med / GRAPH_CALLS, p20 / GRAPH_CALLS, p80 / GRAPH_CALLS)
                    rows.append(_row(case, f"{name}+graph", t, env, calls=n * GRAPH_CALLS))
                except Exception as e:  # noqa: BLE001
                    rows.append(_row(case, f"{name}+graph", None, env, ok=False,
                                     note=f"{type(e).__name__}: {str(e)[:100]}"))
        line = "  ".join(f"{r['provider']} {r['median_ms'] * 1e3:7.1f} us" if r["median_ms"]
                         else f"{r['provider']} -" for r in rows if r["case"] == case.label)
        log(f"{case.op:16s} {case.label:36s} {line}{'' if ok else '  ' + note}")
    if first_calls and not ops:
        rows += first_call_rows(env, log)
    return rows


def table(rows: list[dict]) -> str:
    """One line per case: microseconds per call for every provider."""
    provs: list[str] = []
    for r in rows:
        if r["provider"] not in provs:
            provs.append(r["provider"])
    out = ["| op | case | " + " | ".join(f"{p} us" for p in provs) + " |",
           "|" + " --- |" * (2 + len(provs))]
    cases: dict = {}
    for r in rows:
        cases.setdefault((r["op"], r["case"]), {})[r["provider"]] = r["median_ms"]
    for (op, case), d in cases.items():
        cells = [f"{d[p] * 1e3:.1f}" if d.get(p) else "-" for p in provs]
        out.append(f"| {op} | {case} | " + " | ".join(cells) + " |")
    return "\n".join(out)


def tables(rows: list[dict]) -> str:
    """The per-call table, and the first calls' (milliseconds) under it."""
    per_call = [r for r in rows if r["group"] == "latency"]
    first = [r for r in rows if r["group"] == "first call"]
    text = table(per_call)
    if first:
        provs = list(dict.fromkeys(r["provider"] for r in first))
        cells: dict = {}
        for r in first:
            cells.setdefault((r["op"], r["case"]), {})[r["provider"]] = r["median_ms"]
        text += ("\n\nFirst call in a new process (ms):\n\n| op | case | " +
                 " | ".join(provs) + " |\n|" + " --- |" * (2 + len(provs)) + "\n" +
                 "\n".join(f"| {op} | {case} | " + " | ".join(
                     f"{d[p]:.0f}" if d.get(p) else "-" for p in provs) + " |"
                     for (op, case), d in cells.items()))
    return text


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("ops", nargs="*", help="op names (default: all decode cases)")
    ap.add_argument("--calls", type=int, default=2000)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--no-compile", action="store_true")
    ap.add_argument("--no-graphs", action="store_true")
    ap.add_argument("--out", default=None, help="write <stem>.json/.md here")
    ap.add_argument("--stem", default=None)
    ap.add_argument("--first-calls-child", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.first_calls_child:
        _first_calls_child(args.first_calls_child)
        return 0
    return run_cli(args.ops, args.out, args.stem, calls=args.calls, rounds=args.rounds,
                   compile=not args.no_compile, graphs=not args.no_graphs)


def run_cli(ops, out, stem, **kw) -> int:
    if not torch.cuda.is_available():
        print("tkit bench --group latency: needs a CUDA GPU (host latency is measured on one)")
        return 1
    rows = run(ops=ops or None, **kw)
    print()
    print(tables(rows))
    if out:
        from tkit.bench import report
        from tkit.bench.runner import environment

        env = environment()
        if stem is None:
            dev = "".join(c if c.isalnum() else "-" for c in env["device"]).lower().strip("-")
            stem = f"{dev}-{env['date']}-latency"
        jpath, mpath = report.write_results(rows, out, None, env, stem=stem)
        mpath.write_text(f"# host latency per eager call: {env['device']}, {env['date']}\n\n"
                         f"torch {env['torch']}, triton {env['triton']}, git {env['git_sha']}."
                         "\n\n" + tables(rows) + "\n")
        print(f"\nwrote {jpath} and {mpath}; appended the rows to "
              f"{report.long_form_path(out, env['device'])} and rewrote "
              f"{report.write_readme(out)}")
    return 0 if all(r["ok"] for r in rows if r["provider"] == "tkit") else 1


if __name__ == "__main__":
    raise SystemExit(main())
