"""Launch one warp-specialized Gluon kernel so that compute-sanitizer can watch it.

``python tests/kernels/ws_racecheck_probe.py minimal`` (or ``shaped``: the same with tkit's
partition sizes and register split) launches a kernel whose only shared memory is what Triton's
``warp_specialize`` lowering itself uses: the per-warp state bytes the idle
worker warps read in their switch loop and the captured values the default partition hands to
the workers (a value loaded from memory, so the capture cannot be rematerialised). ``tkit``
launches tkit's warp-specialized attention forward on a small causal shape. Under
``compute-sanitizer --tool racecheck`` the two are compared by
``test_attention_ws_race.py``: a hazard that the minimal kernel shows too belongs to the lowering
(or to racecheck's reading of it), not to tkit's mbarrier pipeline.
"""

from __future__ import annotations

import sys

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl


@gluon.jit
def _probe_partition(out_ptr, base, OFF: gl.constexpr):
    NW: gl.constexpr = gl.num_warps()
    offs = gl.arange(0, 32 * NW, layout=gl.BlockedLayout([1], [32], [NW], [0]))
    gl.store(out_ptr + base + OFF + offs, offs + base)


@gluon.jit
def _minimal_ws_kernel(in_ptr, out_ptr, W1: gl.constexpr, W2: gl.constexpr,
                       R1: gl.constexpr, R2: gl.constexpr):
    """A 4-warp default partition and two workers of W1 and W2 warps (R1, R2 registers), each
    writing its own slice of the program's 128 + 32 * (W1 + W2) outputs."""
    base = gl.load(in_ptr + gl.program_id(0))  # a load: captured through shared memory
    gl.warp_specialize([
        (_probe_partition, (out_ptr, base, 0)),
        (_probe_partition, (out_ptr, base, 128)),
        (_probe_partition, (out_ptr, base, 128 + 32 * W1)),
    ], [W1, W2], [R1, R2])


def run_minimal(shaped: bool, programs: int = 264) -> None:
    """``shaped``: the partitions and register split of tkit's kernel (4 + 4 + 1 warps, 240 and
    24 registers under a launch cap of 168, so the lowering adds its setmaxnreg steps);
    otherwise two 1-warp workers and no register cap."""
    w1, w2, regs = (4, 1, dict(maxnreg=168)) if shaped else (1, 1, {})
    r1, r2 = (240, 24) if shaped else (24, 24)
    per = 128 + 32 * (w1 + w2)
    base = torch.arange(programs, device="cuda", dtype=torch.int32) * per
    out = torch.full((programs * per,), -1, device="cuda", dtype=torch.int32)
    _minimal_ws_kernel[(programs,)](base, out, w1, w2, r1, r2, num_warps=4, **regs)
    torch.cuda.synchronize()
    parts = [torch.arange(32 * w, device="cuda", dtype=torch.int32) for w in (4, w1, w2)]
    want = (torch.cat(parts)[None, :] + base[:, None]).reshape(-1)
    assert torch.equal(out, want), "the minimal warp-specialized kernel wrote wrong values"


def run_tkit() -> None:
    from tkit.kernels.attention import hopper as H

    g = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(1, 300, 4, 128, device="cuda", dtype=torch.bfloat16, generator=g)
               for _ in range(3))
    H.forward(q, k, v, causal=True, config=H.config_dict(128, 3, True))
    torch.cuda.synchronize()


if __name__ == "__main__":
    {"minimal": lambda: run_minimal(False), "shaped": lambda: run_minimal(True),
     "tkit": run_tkit}[sys.argv[1]]()
    print("done")
