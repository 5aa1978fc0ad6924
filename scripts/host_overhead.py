"""tkit's own host time per eager call at decode sizes, on a machine without a GPU.

Two figures per op, microseconds a call (the best of 40 bursts of 200 calls: the minimum
and thread CPU time keep other processes' load on a shared machine out of the figure):

* ``capture``: with launches captured (``capture_launches``): validation, allocation and
  planning, nothing of Triton.
* ``whole call``: the call through :mod:`tkit.kernels._launch`'s fast path with the compiled
  kernel replaced by a no-op (no driver here): what tkit adds on top of Triton's C launcher
  (about 3 us on the H200).
* ``launch layer only``: the captured launches of one call replayed through ``_launch.run``
  (config choice, heuristics, specialization key, cache lookup).

    python scripts/host_overhead.py [--profile OP]      # no TRITON_INTERPRET: real JIT kernels

Run it without TRITON_INTERPRET (kernels must be ``JITFunction`` objects); CPU tensors stand in
for CUDA ones.
"""

from __future__ import annotations

import argparse
import cProfile
import os
import pstats
import sys
import time
from pathlib import Path

os.environ.pop("TRITON_INTERPRET", None)
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

import tkit  # noqa: E402
from tkit import _env  # noqa: E402
from tkit.kernels import _common as C  # noqa: E402
from tkit.kernels import _launch  # noqa: E402


class _NoopCompiled(_launch.CompiledKernel):
    """Stands in for a compiled kernel: what ``run`` is handed is counted, nothing launches."""

    run = None

    def __init__(self):
        self.module = None  # Triton 3.9's __del__ unloads a module when one is set
        self.function = 1
        self.packed_metadata = None
        self.calls = 0
        self.run = self._run

    def _run(self, *args):
        self.calls += 1


def _fake_jit_run(self, *args, grid, warmup, **kwargs):
    if callable(grid):
        grid(kwargs)
    return _NoopCompiled()


def cases():
    bf = torch.bfloat16
    a, b = torch.randn(1, 4096, dtype=bf), torch.randn(1, 4096, dtype=bf)
    w = torch.randn(4096, dtype=bf)
    g, u = torch.randn(1, 14336, dtype=bf), torch.randn(1, 14336, dtype=bf)
    x1 = torch.randn(1, 4096, dtype=bf)
    W = torch.randn(4096, 4096, dtype=bf)
    q = torch.randn(1, 1, 32, 128, dtype=bf)
    k = torch.randn(1, 4096, 8, 128, dtype=bf)
    return {
        "add (1,4096)": lambda: tkit.add(a, b),
        "rms_norm (1,4096)": lambda: tkit.rms_norm(a, w),
        "silu_mul (1,14336)": lambda: tkit.silu_mul(g, u),
        "softmax (1,4096)": lambda: tkit.softmax(a),
        "matmul M=1 4096x4096": lambda: tkit.matmul(x1, W),
        "flash_attention decode 4096 GQA4": lambda: tkit.flash_attention(q, k, k),
    }


def per_call_us(fn, n=200, rounds=40) -> float:
    for _ in range(20):
        fn()
    best = float("inf")
    for _ in range(rounds):
        t0 = time.thread_time()
        for _ in range(n):
            fn()
        best = min(best, (time.thread_time() - t0) / n * 1e6)
    return best


def capture_mode(fn):
    def call():
        with C.capture_launches():
            fn()
    return call


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--profile", default=None, help="cProfile this case (a name prefix)")
    ap.add_argument("-n", type=int, default=200)
    args = ap.parse_args()
    # CPU tensors pass tkit's device check as under the interpreter; kernels stay JIT functions
    _env.INTERPRET = True
    _launch._enabled = True
    _launch._device_stream = lambda: (0, 0)
    _launch.JITFunction.run = _fake_jit_run
    rows = []
    for name, fn in cases().items():
        try:
            cap = per_call_us(capture_mode(fn), args.n)
            full = per_call_us(fn, args.n)
        except Exception as e:  # noqa: BLE001 - report and go on (a CUDA-only step on CPU)
            print(f"{name:34s} skipped: {type(e).__name__}: {str(e)[:80]}")
            continue
        with C.capture_launches() as launches:
            fn()

        def relaunch():
            for lc in launches:
                _launch.run(lc.kernel, lc.grid, dict(lc.kwargs))

        only = per_call_us(relaunch, args.n)
        rows.append((name, cap, full, only))
        print(f"{name:34s} capture {cap:6.1f} us   whole call {full:6.1f} us   "
              f"launch layer only {only:5.1f} us ({len(launches)} launch)")
    print("launch path counters:", _launch.stats)
    if args.profile:
        fn = next(f for n, f in cases().items() if n.startswith(args.profile))
        pr = cProfile.Profile()
        pr.enable()
        for _ in range(args.n):
            fn()
        pr.disable()
        pstats.Stats(pr).sort_stats("tottime").print_stats(20)


if __name__ == "__main__":
    main()
