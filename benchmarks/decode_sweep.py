"""Sweep the decode-attention kernel's launch configuration over its benchmark cases (GPU).

For each chosen bench case of ``decode_attention`` (tkit/specs/decode_attention.py), every
combination of keys per tile, warps, pipeline stages, split counts and split merges runs under
:func:`tkit.kernels.decode.decode_config`, is checked against the float32 reference
once, and is timed as ``tkit bench`` times (L2 flushed, medians); SDPA's cuDNN backend on the
same dense tensors is timed in the same run where it applies. Prints a table and appends
long-form rows (JSON lines) to ``--out``. The defaults in ``DecodeConfig.for_device`` come from
what this finds.

    python benchmarks/decode_sweep.py [--cases 0,1,3,6] [--out FILE]
    python benchmarks/decode_sweep.py --cases 11 --block-n 64 --warps 8 --stages 3 \
        --splits 0,8,16,32 --combine launch,fused        # one short sequence: splits, merges
"""

from __future__ import annotations

import argparse
import itertools
import json
import time

import torch


def main(argv=None) -> int:
    from tkit import registry
    from tkit.bench.runner import environment

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cases", default="0,1,3,6", help="indices into the op's bench cases")
    ap.add_argument("--block-n", default="32,64,128")
    ap.add_argument("--warps", default="4,8")
    ap.add_argument("--stages", default="2,3")
    ap.add_argument("--splits", default="0", help="num_splits values (0: the heuristic's)")
    ap.add_argument("--combine", default="launch", help="split merges: launch, fused")
    ap.add_argument("--budget", type=float, default=120.0, help="seconds for the sweep")
    ap.add_argument("--out", default=None, help="JSON lines file to append rows to")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("decode_sweep: needs a CUDA GPU")
        return 1
    spec = registry.get("decode_attention")
    cases = spec.bench_cases()
    env = environment()
    grid = list(itertools.product(*(map(int, a.split(",")) for a in
                                    (args.block_n, args.warps, args.stages, args.splits)),
                                  args.combine.split(",")))
    baselines = spec.available_baselines()
    rows = []
    picked = [int(i) for i in args.cases.split(",")]
    for idx in picked:
        rows += _sweep_case(spec, cases[idx], grid, baselines, env,
                            time.time() + args.budget / len(picked))
        torch.cuda.empty_cache()
    if args.out:
        with open(args.out, "a") as f:
            for r in rows:
                f.write(json.dumps(r, default=str) + "\n")
    return 0


def _sweep_case(spec, case, grid, baselines, env, t_end) -> list[dict]:
    from tkit.bench.runner import _verify
    from tkit.bench.timing import time_fn
    from tkit.kernels import decode as DA

    a, kw = case.make("cuda")
    cost = spec.cost(*a, **kw)
    results = []
    if "sdpa_cudnn" in baselines:
        try:
            t = time_fn(lambda: baselines["sdpa_cudnn"](*a, **kw))
            results.append(("sdpa_cudnn", t.median_ms, True))
        except Exception as e:  # noqa: BLE001 - a baseline that declines the case
            results.append(("sdpa_cudnn", None, type(e).__name__))
    for block_n, warps, stages, splits, combine in grid:
        if time.time() > t_end:
            break
        label = (f"block_n={block_n} warps={warps} stages={stages}"
                 + (f" splits={splits}" if splits else "")
                 + (f" combine={combine}" if combine != "launch" else ""))
        try:
            with DA.decode_config(block_n=block_n, num_warps=warps, num_stages=stages,
                                  num_splits=splits or None, combine=combine):
                ok, note = _verify(spec, a, kw)
                t = time_fn(lambda: spec.fn(*a, **kw))
            results.append((label, t.median_ms, ok or note))
        except Exception as e:  # noqa: BLE001 - e.g. out of shared memory
            results.append((label, None, f"{type(e).__name__}: {str(e)[:80]}"))
    print(f"\n{case.label}  ({cost.bytes / 1e9:.2f} GB)")
    rows, best = [], None
    for label, ms, ok in results:
        tbps = cost.bytes / (ms * 1e-3) / 1e12 if ms else None
        if ms and ok is True and label != "sdpa_cudnn" and (best is None or ms < best[1]):
            best = (label, ms)
        print(f"  {label:36s} " + (f"{ms * 1e3:8.1f} us {tbps:5.2f} TB/s" if ms else "  -")
              + ("" if ok is True else f"  {ok}"))
        rows.append({"op": spec.name, "case": case.label, "provider": label, "median_ms": ms,
                     "tbps": tbps, "ok": ok is True, "note": "" if ok is True else str(ok),
                     **env})
    if best:
        print(f"  best: {best[0]}")
    return rows


if __name__ == "__main__":
    raise SystemExit(main())
