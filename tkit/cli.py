"""The ``tkit`` command: ``tkit info``, ``tkit bench [OPS...]``, ``tkit ir OP``."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path


def _prepare_backend() -> bool:
    """True with a GPU. Without one, switch on Triton's interpreter before any kernel module is
    imported (triton.jit reads the switch when a kernel is defined)."""
    import torch

    if torch.cuda.is_available():
        return True
    os.environ.setdefault("TRITON_INTERPRET", "1")
    return False


def _print_nested(d: dict, indent: int) -> None:
    for k, v in d.items():
        if isinstance(v, dict):
            print(" " * indent + f"{k}:")
            _print_nested(v, indent + 2)
        else:
            print(" " * indent + f"{k}: {v}")


def cmd_info(args) -> int:
    import platform

    import torch
    import triton

    has_gpu = _prepare_backend()
    from tkit import registry
    from tkit.bench import ceilings

    print(f"tkit {__import__('tkit').__version__}  python {platform.python_version()}  "
          f"torch {torch.__version__}  triton {triton.__version__}")
    if has_gpu:
        p = torch.cuda.get_device_properties(0)
        print(f"device: {p.name}, sm_{p.major}{p.minor}, {p.multi_processor_count} SMs, "
              f"{p.total_memory / 2**30:.0f} GiB")
        c = ceilings.cached()
        print("ceilings: " + (f"copy {c.copy_tbps:.2f} TB/s, bf16 matmul {c.bf16_tflops:.0f} "
                              f"TFLOP/s (measured {c.measured_at})" if c else
                              "not measured yet (tkit bench measures them)"))
        path = f"Triton, compiled for sm_{p.major}{p.minor}"
    else:
        print("device: no CUDA GPU; kernels run in Triton's interpreter (correctness only)")
        path = "Triton interpreter"
    try:
        from tkit import cuda_ext

        st = cuda_ext.status()
    except Exception as e:  # the escape hatches are optional: say why they are off
        print(f"CUDA escape hatches: unavailable ({type(e).__name__}: {e})")
    else:
        print("CUDA escape hatches:")
        _print_nested(st if isinstance(st, dict) else {"status": st}, indent=2)
    from tkit.kernels.attention import hopper_status

    print(f"flash_attention forward: {hopper_status()}")
    try:
        from tkit.kernels.matmul import gemm_hopper
    except ImportError as e:  # a Triton without Gluon's Hopper API
        print(f"matmul (16-bit): Triton kernels (Gluon unavailable: {e})")
    else:
        print(f"matmul (16-bit): {gemm_hopper.status()}")
    print("ops:")
    for spec in registry.all_specs():
        where = "CUDA through cupy (see above)" if spec.family == "cuda_ext" else path
        print(f"  {spec.name:<24} {spec.family:<12} {where}")
    return 0


def _usage_error(msg: str) -> int:
    print(f"tkit bench: {msg}", file=sys.stderr)
    return 2


def _unknown_groups(specs, groups) -> str:
    """An error message for the groups that no case of ``specs`` is in (empty if none)."""
    from tkit.registry import suggest

    known = [c.group for s in specs for c in (*s.bench_cases(), *s.check_cases())]
    bad = [g for g in groups or [] if g not in known]
    if not bad:
        return ""
    hints = "".join(f"\n  --group {g!r}: no case of the chosen ops is in it{suggest(g, known)}"
                    for g in bad)
    return f"unknown group:{hints}\n(their groups: {', '.join(dict.fromkeys(known))})"


def cmd_bench(args) -> int:
    if args.group and "latency" in args.group:  # host latency: its own measurement
        from tkit.bench import latency

        return latency.run_cli(args.ops, args.out, args.stem)
    has_gpu = _prepare_backend()
    from tkit import registry

    try:
        specs = registry.select(args.ops)
    except KeyError as e:
        return _usage_error(e.args[0])
    if args.case_timeout <= 0:
        return _usage_error(f"--case-timeout must be positive, got {args.case_timeout}")
    if args.warm_jobs < 0:
        return _usage_error(f"--warm-jobs must be 0 or more, got {args.warm_jobs}")
    if args.rounds is not None and args.rounds < 1:
        return _usage_error(f"--rounds must be at least 1, got {args.rounds}")
    bad_groups = _unknown_groups(specs, args.group)
    if bad_groups:
        return _usage_error(bad_groups)
    if not has_gpu:
        return _check_without_gpu(args, specs)
    return _bench_on_gpu(args, specs)


def _check_without_gpu(args, specs) -> int:
    from tkit.bench import report, runner
    from tkit.bench.progress import Reporter

    print("tkit bench: timings need a CUDA GPU, and none is visible here.\n"
          "Checking ops against their references in Triton's interpreter at small sizes "
          "instead; nothing is timed and no results file is written.")
    if args.quick:
        print("  --quick: each op's first check case only")
    if args.group:
        print(f"  --group {', '.join(args.group)}: the check cases of these groups only")
    if args.plot:
        print("  --plot: ignored here (no timings to plot without a GPU)")
    todo = runner.check_plan(specs, args.group, args.quick)
    checked = list(dict.fromkeys(s.name for s, _ in todo))
    skipped: dict[str, list[str]] = {}  # why -> ops
    for s in specs:
        if s.name in checked:
            continue
        why = (s.no_check_reason or "no check cases" if not s.check_cases() else
               f"no check case in group {', '.join(args.group)}")
        skipped.setdefault(why, []).append(s.name)
    n_skipped = sum(len(ops) for ops in skipped.values())
    print(f"checking {len(checked)} ops ({len(todo)} cases): {', '.join(checked) or 'none'}")
    if skipped:
        print(f"skipped {n_skipped} ops:")
        for why, ops in skipped.items():
            print(f"  {', '.join(ops)}: {why}")
    print()
    reporter = Reporter(len(todo), "check", bar=args.progress,
                        lines=not (args.progress or (args.progress is None
                                                     and sys.stderr.isatty())))
    rows = runner.check_specs(specs, groups=args.group, quick=args.quick, reporter=reporter)
    if rows:
        print(report.check_table(rows))
    bad = [r for r in rows if not r["ok"]]
    print(f"\n{len(rows) - len(bad)} passed, {len(bad)} failed; {len(checked)} ops checked, "
          f"{n_skipped} skipped")
    if not rows:
        print("nothing was checked here (the skipped ops above say why)")
        return 1
    return 1 if bad else 0


def _bench_on_gpu(args, specs) -> int:
    import torch

    from tkit.bench import ceilings as ceil
    from tkit.bench import estimate, runner
    from tkit.bench.progress import Reporter

    out_dir = Path(args.out)
    if args.rounds is None:
        args.rounds = 1 if args.quick else 3
    c = ceil.get(remeasure=args.remeasure)
    torch.cuda.empty_cache()  # the children get the memory the measurement used
    print(f"ceilings on {c.device}: copy {c.copy_tbps:.2f} TB/s, "
          f"bf16 matmul {c.bf16_tflops:.0f} TFLOP/s")
    todo = runner.plan(specs, args.group, args.quick)
    planned = {p.spec.name for p in todo}
    none = [s.name for s in specs if s.name not in planned]
    if none:
        print(f"no bench case in group {', '.join(args.group or [])} for: {', '.join(none)}")
    if not todo:
        print("nothing to time")
        return 1
    est = estimate.estimate([(p.spec.name, p.spec.family, p.case.label) for p in todo],
                            out_dir, c.device, args.rounds, args.rep_ms,
                            0 if args.in_process else args.warm_jobs)
    print(estimate.describe(est, len(todo)))
    print("each case runs in a child process (a fault costs that case only)" if
          not args.in_process else "cases run in this process (--in-process): a fault that "
          "loses the CUDA context fails every later case")
    reporter = Reporter(len(todo), "bench", bar=args.progress)
    rows = runner.bench_specs(specs, c, rounds=args.rounds, rep_ms=args.rep_ms,
                              baselines=not args.no_baselines, groups=args.group,
                              cuda_graph=args.cuda_graph, l2=args.l2, timer=args.timer,
                              quick=args.quick,
                              isolate=not args.in_process, case_timeout=args.case_timeout,
                              reporter=reporter, warm_jobs=args.warm_jobs)
    return _report(args, rows, c, out_dir)


def _report(args, rows, c, out_dir) -> int:
    """The table, the results files and the plot, whatever failed; the exit status."""
    from tkit.bench import report, runner

    print(report.terminal_table(rows))
    env = runner.environment()
    jpath, mpath = report.write_results(rows, out_dir, c, env, stem=args.stem)
    print(f"\nwrote {jpath} and {mpath}; appended the rows to "
          f"{report.long_form_path(out_dir, env.get('device', ''))} "
          f"and rewrote {report.write_readme(out_dir)}")
    if args.plot:
        png = report.plot_roofline(rows, c, mpath.with_suffix(".png"))
        if png:
            print(f"wrote {png}")
    mine = [r for r in rows if r["provider"] == "tkit"]
    failed = [r for r in mine if not r["median_ms"]]
    wrong = [r for r in mine if r["median_ms"] and not r["ok"]]
    print(f"{len(mine)} cases: {len(mine) - len(failed) - len(wrong)} timed and verified, "
          f"{len(wrong)} timed but wrong, {len(failed)} failed")
    for r in failed + wrong:
        print(f"  {r['op']} {r['case']}: {r['note'][:300]}")
    if not getattr(args, "no_baselines", False):
        for op, names in report.missing_baselines(rows).items():
            print(f"  {op}: no rows for {', '.join(names)}: not available here (not installed "
                  "in this Python, or its probe failed)")
    return 1 if failed or wrong else 0


def _default_warm_jobs() -> int:
    import os

    return max(1, min(8, (os.cpu_count() or 2) // 2))


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="tkit", description=__doc__)
    sub = p.add_subparsers(dest="command", required=True)
    sub.add_parser("info", help="device, versions, ceilings, and the path each op takes")
    b = sub.add_parser(
        "bench", help="benchmark ops against baselines (checks them on CPU)",
        description="Time tkit ops and their baselines on a CUDA GPU (each case in a child "
        "process), or, without a GPU, check them against their references in Triton's "
        "interpreter.",
        epilog="exit status: 0 every case ran and was right; 1 a case failed, was wrong, or "
        "nothing could be run here; 2 an unknown op, family or group.")
    b.add_argument("ops", nargs="*", help="op names or families (default: all)")
    b.add_argument("--out", default="benchmarks/results",
                   help="where the run's JSON/markdown go; its rows are appended to "
                   "<out>/<device>.jsonl and <out>/README.md is regenerated")
    b.add_argument("--stem", default=None, help="file name stem (default: device-date)")
    b.add_argument("--rounds", type=int, default=None,
                   help="interleaved rounds per case (default 3; 1 with --quick, whose case "
                   "time goes mostly to first calls: compiles and torch.compile's baselines)")
    b.add_argument("--rep-ms", type=int, default=100, help="timing window per measurement")
    b.add_argument("--group", action="append", help="only cases of this group (repeatable)")
    b.add_argument("--quick", action="store_true",
                   help="each op's first (headline) case only: the whole toolkit in minutes")
    b.add_argument("--no-baselines", action="store_true")
    b.add_argument("--cuda-graph", action="store_true", help="time CUDA-graph replays")
    b.add_argument("--l2", choices=("read", "write"), default="read",
                   help="make the L2 cold before each run by reading a 256 MB buffer (default) "
                        "or by zeroing it as triton's do_bench does (leaves it dirty)")
    b.add_argument("--timer", choices=("events", "kernels"), default="events",
                   help="what times a run: CUDA events around it (default), or its kernels' "
                   "span on the device from the profiler's records, without the ~3.5 us a "
                   "stream spends around any run")
    b.add_argument("--remeasure", action="store_true", help="measure the ceilings again")
    b.add_argument("--plot", action="store_true", help="write a roofline PNG (GPU runs)")
    b.add_argument("--progress", action=argparse.BooleanOptionalAction, default=None,
                   help="a live progress bar (default: when stderr is a terminal); on a GPU a "
                   "line per finished case is printed either way")
    b.add_argument("--in-process", action="store_true",
                   help="run the cases in this process (debugging): a fault that loses the "
                   "CUDA context then fails every later case")
    b.add_argument("--warm-jobs", type=int, default=_default_warm_jobs(),
                   help="child processes that make every case's first calls (compiles, "
                   "torch.compile of the baselines) in parallel before the timing, which "
                   "runs one case at a time (default: half the CPU cores, at most 8; 0: no "
                   "warm-up; not with --in-process)")
    b.add_argument("--case-timeout", type=float, default=900.0,
                   help="seconds a case may take before its child is killed (default 900)")
    pr = sub.add_parser(
        "profile", help="an op's benchmark case under Nsight Compute, with a diagnosis",
        description="Run one benchmark case of an op under ncu (the kernels of one warm call), "
        "print each kernel's time and what bounds it (tkit.profile.diagnose).",
        epilog="exit status: 0 profiled; 1 ncu missing or failed; 2 an unknown op.")
    pr.add_argument("op", help="a registered op")
    pr.add_argument("--case", type=int, default=0, help="which benchmark case (default 0)")
    pr.add_argument("--kernel", default=None, help="only kernels whose name matches (regex)")
    pr.add_argument("--ncu", default=None, help="the ncu executable (default: TKIT_NCU, PATH)")
    try:
        from tkit.ir_tools import cli as ir_cli
    except ImportError:
        ir_cli = None
    if ir_cli is not None:
        ir_cli.add_parser(sub)
    return p


def cmd_profile(args) -> int:
    from tkit import registry
    from tkit.profile import profile, report

    try:
        registry.get(args.op)
    except KeyError as e:
        print(f"tkit profile: {e.args[0] if e.args else e}", file=sys.stderr)
        return 2
    try:
        kernels = profile(args.op, args.case, args.kernel, args.ncu)
    except (RuntimeError, ValueError) as e:
        print(f"tkit profile: {e}", file=sys.stderr)
        return 1
    for k in kernels:
        print(report(k))
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] != "ir":
        # before build_parser: it imports tkit.ir_tools, and importing that before the
        # interpreter switch leaves the interpreter unable to run nested jit functions
        _prepare_backend()
    args = build_parser().parse_args(argv)
    if args.command == "info":
        return cmd_info(args)
    if args.command == "bench":
        return cmd_bench(args)
    if args.command == "profile":
        return cmd_profile(args)
    if args.command == "ir":
        # no interpreter switch: tkit.ir compiles ahead of time, and under the interpreter the
        # autotuned kernels would only offer their interpreter config
        from tkit.ir_tools import cli as ir_cli

        return ir_cli.run(args)
    return 2


if __name__ == "__main__":
    sys.exit(main())
