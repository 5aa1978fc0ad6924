"""Specs whose cases pass, raise, lose the CUDA context and kill their process, for the tests of
a ``tkit bench`` run that survives its failures (no GPU needed: a fake timer stands in)."""

from __future__ import annotations

import os

import torch

from tkit.bench.timing import Timing
from tkit.registry import Case, Cost, OpSpec


def _fault(a):
    """A Triton kernel that stores far past ``a``'s memory: an illegal address on a GPU."""
    import triton
    import triton.language as tl

    @triton.jit
    def _store_far_away(x_ptr):
        tl.store(x_ptr + (1 << 40), 1.0)

    _store_far_away[(1,)](a)
    torch.cuda.synchronize()


def _log(what: str) -> None:
    """With FAKE_BENCH_LOG set: a line a call (process id, what, inductor's compile threads,
    whether the process is a warm-up child), for tests of which process made which call in
    what order."""
    import sys

    path = os.environ.get("FAKE_BENCH_LOG")
    if path:
        warm = '"warm": true' in " ".join(sys.argv)
        with open(path, "a") as f:
            f.write(f"{os.getpid()} {what} {os.environ.get('TORCHINDUCTOR_COMPILE_THREADS')} "
                    f"{'warm' if warm else 'timing'}\n")


def fake_op(a, b, mode="ok"):
    _log(mode)
    if mode == "fault":
        _fault(a)
    if mode == "raise":
        raise ValueError("boom: this case's kernel refuses its inputs")
    if mode == "lost":
        raise RuntimeError("CUDA error: an illegal memory access was encountered")
    if mode == "die":
        print("about to die", flush=True)
        os._exit(3)
    return a + b


def fake_reference(a, b, mode="ok"):
    return a + b


def fake_time_fn(fn, **kw):
    """Calls ``fn`` once (so that its failures surface) and reports 1 ms."""
    _log("timed")
    fn()
    return Timing(1.0, 0.9, 1.1)


def _case(mode):
    def make(device):
        # the CLI asks for "cuda": on a machine without one, the tests drive it on the CPU
        device = device if torch.cuda.is_available() else "cpu"
        a = torch.randn(64, 32, generator=torch.Generator().manual_seed(1)).to(device)
        b = torch.randn(64, 32, generator=torch.Generator().manual_seed(2)).to(device)
        return (a, b), {"mode": mode}

    return Case(f"64x32 {mode}", make, "fake")


def spec(name, modes):
    return OpSpec(name=name, family="fake", fn=fake_op, reference=fake_reference,
                  cost=lambda a, b, mode="ok": Cost(bytes=3 * a.numel() * a.element_size(),
                                                    flops=a.numel()),
                  bench_cases=lambda: [_case(m) for m in modes], check_cases=lambda: [],
                  fuzz=lambda: {}, baselines={"torch": lambda: fake_reference})


SPECS = [spec("fake_a", ["ok", "raise", "lost"]), spec("fake_b", ["die", "ok"])]
#: on a GPU: a real fault, with real timings around it
GPU_SPECS = [spec("fake_gpu", ["ok", "fault", "ok"])]
