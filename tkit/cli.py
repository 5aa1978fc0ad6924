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
    print("ops:")
    for spec in registry.all_specs():
        where = "CUDA through cupy (see above)" if spec.family == "cuda_ext" else path
        print(f"  {spec.name:<24} {spec.family:<12} {where}")
    return 0


def cmd_bench(args) -> int:
    if args.group and "latency" in args.group:  # host latency: its own measurement
        from tkit.bench import latency

        return latency.run_cli(args.ops, args.out, args.stem)
    has_gpu = _prepare_backend()
    from tkit import registry
    from tkit.bench import report, runner

    specs = registry.select(args.ops)
    out_dir = Path(args.out)
    if not has_gpu:
        print("tkit bench: timings need a CUDA GPU, and none is visible here.\n"
              "Checking every op against its reference in Triton's interpreter at small sizes "
              "instead.\n")
        rows = runner.check_specs(specs, progress=args.progress)
        print(report.check_table(rows))
        bad = [r for r in rows if not r["ok"]]
        print(f"\n{len(rows) - len(bad)} passed, {len(bad)} failed")
        return 1 if bad else 0

    from tkit.bench import ceilings as ceil

    c = ceil.get(remeasure=args.remeasure)
    print(f"ceilings on {c.device}: copy {c.copy_tbps:.2f} TB/s, "
          f"bf16 matmul {c.bf16_tflops:.0f} TFLOP/s")
    rows = runner.bench_specs(specs, c, rounds=args.rounds, rep_ms=args.rep_ms,
                              baselines=not args.no_baselines, groups=args.group,
                              cuda_graph=args.cuda_graph, progress=args.progress,
                              quick=args.quick)
    print(report.terminal_table(rows))
    env = runner.environment()
    jpath, mpath = report.write_results(rows, out_dir, c, env, stem=args.stem)
    print(f"\nwrote {jpath} and {mpath}")
    if args.plot:
        png = report.plot_roofline(rows, c, mpath.with_suffix(".png"))
        if png:
            print(f"wrote {png}")
    return 0 if all(r["ok"] for r in rows if r["provider"] == "tkit") else 1


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="tkit", description=__doc__)
    sub = p.add_subparsers(dest="command", required=True)
    sub.add_parser("info", help="device, versions, ceilings, and the path each op takes")
    b = sub.add_parser("bench", help="benchmark ops against baselines (checks them on CPU)")
    b.add_argument("ops", nargs="*", help="op names or families (default: all)")
    b.add_argument("--out", default="benchmarks/results", help="where JSON/markdown go")
    b.add_argument("--stem", default=None, help="file name stem (default: device-date)")
    b.add_argument("--rounds", type=int, default=3, help="interleaved rounds per case")
    b.add_argument("--rep-ms", type=int, default=100, help="timing window per measurement")
    b.add_argument("--group", action="append", help="only cases of this group (repeatable)")
    b.add_argument("--quick", action="store_true",
                   help="each op's first (headline) case only: the whole toolkit in minutes")
    b.add_argument("--no-baselines", action="store_true")
    b.add_argument("--cuda-graph", action="store_true", help="time CUDA-graph replays")
    b.add_argument("--remeasure", action="store_true", help="measure the ceilings again")
    b.add_argument("--plot", action="store_true", help="write a roofline PNG")
    b.add_argument("--progress", action="store_true", default=None,
                   help="force the progress bar (default: when stderr is a terminal)")
    try:
        from tkit.ir_tools import cli as ir_cli
    except ImportError:
        ir_cli = None
    if ir_cli is not None:
        ir_cli.add_parser(sub)
    return p


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
    if args.command == "ir":
        # no interpreter switch: tkit.ir compiles ahead of time, and under the interpreter the
        # autotuned kernels would only offer their interpreter config
        from tkit.ir_tools import cli as ir_cli

        return ir_cli.run(args)
    return 2


if __name__ == "__main__":
    sys.exit(main())
