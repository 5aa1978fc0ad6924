"""Launch one warp-specialized Gluon kernel so that compute-sanitizer can watch it.

``python tests/kernels/ws_racecheck_probe.py minimal`` launches a kernel whose only shared memory
is what Triton's ``warp_specialize`` lowering itself uses: the per-warp state bytes the idle
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
def _minimal_worker(out_ptr, base, WG: gl.constexpr):
    offs = gl.arange(0, 32, layout=gl.BlockedLayout([1], [32], [1], [0]))
    gl.store(out_ptr + base + 128 + WG * 32 + offs, offs + base)


@gluon.jit
def _minimal_default(out_ptr, base):
    offs = gl.arange(0, 128, layout=gl.BlockedLayout([1], [32], [4], [0]))
    gl.store(out_ptr + base + offs, offs + base)


@gluon.jit
def _minimal_ws_kernel(in_ptr, out_ptr):
    base = gl.load(in_ptr + gl.program_id(0))  # a load: captured through shared memory
    gl.warp_specialize([
        (_minimal_default, (out_ptr, base)),
        (_minimal_worker, (out_ptr, base, 0)),
        (_minimal_worker, (out_ptr, base, 1)),
    ], [1, 1], [24, 24])


def run_minimal(programs: int = 264) -> None:
    base = torch.arange(programs, device="cuda", dtype=torch.int32) * 192
    out = torch.full((programs * 192,), -1, device="cuda", dtype=torch.int32)
    _minimal_ws_kernel[(programs,)](base, out, num_warps=4)
    torch.cuda.synchronize()
    want = torch.cat([torch.arange(128, device="cuda", dtype=torch.int32),
                      torch.arange(32, device="cuda", dtype=torch.int32).repeat(2)])
    want = (want[None, :] + base[:, None]).reshape(-1)
    assert torch.equal(out, want), "the minimal warp-specialized kernel wrote wrong values"


def run_tkit() -> None:
    from tkit.kernels import attention_hopper as H

    g = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(1, 300, 4, 128, device="cuda", dtype=torch.bfloat16, generator=g)
               for _ in range(3))
    H.forward(q, k, v, causal=True, config=H.config_dict(128, 3, True))
    torch.cuda.synchronize()


if __name__ == "__main__":
    {"minimal": run_minimal, "tkit": run_tkit}[sys.argv[1]]()
    print("done")
