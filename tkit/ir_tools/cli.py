"""``tkit ir OP [--arch sm_90] [--stage ptx] [--summary] [--config ...] [--shape ...]``.

``add_parser(subparsers)`` registers the subcommand; ``run(args)`` executes it and returns the
exit status (2 for bad input, with the reason on stderr).
"""

from __future__ import annotations

import argparse
import json
import sys

from tkit.ir_tools.aot import STAGES, IRError, parse_config, parse_shape


def add_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "ir", help="show what the compiler did for an op (TTGIR/PTX/SASS, layouts, registers)",
        description="Compile a tkit op ahead of time (no GPU needed) and show one stage of its "
                    "IR or a summary: layouts in words, pipelining, registers, shared memory, "
                    "occupancy, instruction histograms and the main loop's own (its barriers, "
                    "shared and local memory, layout conversions).")
    p.add_argument("op", help="registered op name, e.g. add, rms_norm, matmul")
    p.add_argument("--arch", default=None,
                   help="target: sm_80, sm_90 (sm_90a)...; default: the local GPU, else sm_90")
    p.add_argument("--stage", default="ttgir", choices=STAGES, help="stage to print")
    p.add_argument("--summary", action="store_true", help="print the summary instead")
    p.add_argument("--json", action="store_true", help="with --summary: print it as JSON")
    p.add_argument("--config", default=None,
                   help="autotune config: an index, or NAME=VALUE pairs such as "
                        "BLOCK=1024,num_warps=8,num_stages=3 (over config 0)")
    p.add_argument("--shape", action="append", default=None, metavar="SHAPE[:DTYPE]",
                   help="one shape per tensor argument of the op, in order (repeat --shape, or "
                        "separate with ';'); e.g. rms_norm takes x and weight: "
                        "--shape '64x4096:bf16;4096:bf16'")
    p.add_argument("--case", default=None,
                   help="which benchmark case of the op (index or part of its label)")
    p.add_argument("--launch", default="0",
                   help="for ops that launch several kernels: index or kernel name")
    p.add_argument("--line", default=None,
                   help="show the PTX/SASS of one kernel source line (number or text)")
    p.add_argument("--locs", action="store_true", help="keep MLIR location annotations")
    p.set_defaults(func=run)
    return p


def run(args) -> int:
    import tkit.ir_tools as ir

    try:
        shapes = None
        if args.shape:
            shapes = [parse_shape(s) for group in args.shape for s in group.split(";") if s]
        config = parse_config(args.config) if args.config else None
        launch = int(args.launch) if str(args.launch).isdigit() else args.launch
        compiled = ir.compile(args.op, arch=args.arch, config=config, launch=launch,
                              case=args.case, shapes=shapes)
        if args.line is not None:
            line = int(args.line) if str(args.line).isdigit() else args.line
            ir.source_map(compiled, line)
        elif args.summary:
            s = ir.summary(compiled, echo=not args.json)
            if args.json:
                print(json.dumps(s.as_dict(), indent=1, default=str))
        else:
            ir.show(compiled, stage=args.stage, locs=args.locs)
    except (IRError, KeyError, ValueError) as e:
        msg = e.args[0] if isinstance(e, KeyError) and e.args else str(e)
        print(f"tkit ir: error: {msg}", file=sys.stderr)
        return 2
    return 0


def main(argv=None) -> int:
    """Stand-alone entry (``python -m tkit.ir_tools.cli OP ...``) until ``tkit`` wires it."""
    parser = argparse.ArgumentParser(prog="tkit")
    sub = parser.add_subparsers(dest="command", required=True)
    add_parser(sub)
    args = parser.parse_args(["ir", *(sys.argv[1:] if argv is None else argv)])
    return args.func(args)


if __name__ == "__main__":
    raise SystemExit(main())
