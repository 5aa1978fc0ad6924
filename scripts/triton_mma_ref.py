"""A plain Triton tl.dot GEMM, the yardstick for the CUDA mma.sync kernel on Hopper (issue #7).

With DISABLE_MMA_V3=1, Triton 3.x lowers tl.dot to mma.sync (MMAv2) instead of wgmma on sm_90:
what this kernel reaches then is what a tuned compiler gets out of mma.sync on the chip. The
switch is read when a kernel is compiled (and is part of Triton's cache key), so one process can
hold both: :class:`TritonGemm` compiles (autotunes) its kernel under the switch in
:meth:`TritonGemm.prepare`, restores the environment, and later calls reuse the compiled
kernels. Each instance wraps the kernel in a fresh ``triton.jit`` (Triton's in-memory kernel
cache is per JIT function and does not look at the environment).

The kernel lives in this file because ``@triton.jit`` reads the function's source from a file
(a kernel defined in ``python -c`` code fails with "@jit functions should be defined in a Python
file"). No GPU is needed to import it.
"""

from __future__ import annotations

import contextlib
import os
import time

import triton
import triton.language as tl

# (BM, BN, BK, warps, stages); 128x256 / 256x128 with 8 warps give each warp a 64 x 64 tile, as
# the CUDA kernel's best builds do. Triton keeps stages - 1 buffers in shared memory (checked on
# sm_90 with DISABLE_MMA_V3=1: cp.async, ldmatrix and mma.sync in the PTX, 96 KiB at 3 stages of
# 128x256x64)
CONFIGS = [triton.Config(dict(BM=bm, BN=bn, BK=bk, GROUP_M=8), num_warps=w, num_stages=s)
           for bm, bn, bk, w, s in ((128, 256, 64, 8, 3), (256, 128, 64, 8, 3),
                                    (128, 256, 64, 8, 4), (256, 128, 64, 8, 4),
                                    (128, 256, 32, 8, 4), (256, 128, 32, 8, 4),
                                    (128, 128, 64, 4, 4))]


def _mm(a, b, c, M, N, K, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
        GROUP_M: tl.constexpr):
    """c = a @ b for row-major bf16 a [M, K], b [K, N]; M % BM == N % BN == K % BK == 0."""
    pid = tl.program_id(0)
    npm = tl.cdiv(M, BM)
    npn = tl.cdiv(N, BN)
    width = GROUP_M * npn
    g = pid // width
    first = g * GROUP_M
    gs = tl.minimum(npm - first, GROUP_M)
    pm = first + (pid % width) % gs
    pn = (pid % width) // gs
    rm = pm * BM + tl.arange(0, BM)
    rn = pn * BN + tl.arange(0, BN)
    rk = tl.arange(0, BK)
    acc = tl.zeros((BM, BN), tl.float32)
    for k in range(0, tl.cdiv(K, BK)):
        x = tl.load(a + rm[:, None] * K + (k * BK + rk)[None, :])
        y = tl.load(b + (k * BK + rk)[:, None] * N + rn[None, :])
        acc = tl.dot(x, y, acc)
    tl.store(c + rm[:, None] * N + rn[None, :], acc.to(tl.bfloat16))


def make_kernel(configs=None):
    """A fresh autotuned JIT function (its own in-memory caches)."""
    return triton.autotune(configs or CONFIGS, key=["M", "N", "K"])(triton.jit(_mm))


@contextlib.contextmanager
def mma_v3_disabled(disable: bool):
    """DISABLE_MMA_V3=1 (or unset) while Triton compiles inside the block; restored after."""
    old = os.environ.get("DISABLE_MMA_V3")
    if disable:
        os.environ["DISABLE_MMA_V3"] = "1"
    else:
        os.environ.pop("DISABLE_MMA_V3", None)
    try:
        yield
    finally:
        if old is None:
            os.environ.pop("DISABLE_MMA_V3", None)
        else:
            os.environ["DISABLE_MMA_V3"] = old


def instructions(compiled) -> dict:
    """Which tensor-core instruction the compiled kernel's PTX uses."""
    ptx = ""
    with contextlib.suppress(Exception):
        ptx = compiled.asm["ptx"]
    return dict(ptx_seen=bool(ptx), ptx_mma_sync="mma.sync" in ptx, ptx_wgmma="wgmma" in ptx)


class TritonGemm:
    """fn(a, b) -> a @ b with the plain Triton kernel, mma.sync (``mma_sync=True``) or wgmma."""

    def __init__(self, mma_sync: bool = True, configs=None):
        self.mma_sync = mma_sync
        self.kernel = make_kernel(configs)
        self.info: dict[tuple, dict] = {}

    def _launch(self, a, b, c):
        import triton as _t

        M, K = a.shape
        N = b.shape[1]
        grid = lambda m: (_t.cdiv(M, m["BM"]) * _t.cdiv(N, m["BN"]),)  # noqa: E731
        return self.kernel[grid](a, b, c, M, N, K)

    def prepare(self, a, b) -> dict:
        """Autotune and compile for this shape under the switch; check the PTX and the error."""
        import torch

        M, K = a.shape
        N = b.shape[1]
        for name, (x, t) in dict(M=(M, "BM"), N=(N, "BN"), K=(K, "BK")).items():
            if any(x % cfg.kwargs[t] for cfg in self.kernel.configs):
                raise ValueError(f"{name} = {x} must be a multiple of every config's {t}")
        c = torch.empty(M, N, device=a.device, dtype=torch.bfloat16)
        t0 = time.time()
        with mma_v3_disabled(self.mma_sync):
            compiled = self._launch(a, b, c)
            torch.cuda.synchronize()
        ref = a.float() @ b.float()
        err = ((c.float() - ref).abs().max() / ref.abs().max()).item()
        info = dict(tune_s=time.time() - t0, best=str(self.kernel.best_config), rel_err=err,
                    **instructions(compiled))
        self.info[(M, N, K)] = info
        return info

    def verify(self, a, b) -> dict:
        """After timing: the kernel that ran is still the one compiled under the switch."""
        import torch

        c = torch.empty(a.shape[0], b.shape[1], device=a.device, dtype=torch.bfloat16)
        return instructions(self._launch(a, b, c))

    def __call__(self, a, b):
        import torch

        c = torch.empty(a.shape[0], b.shape[1], device=a.device, dtype=torch.bfloat16)
        self._launch(a, b, c)
        return c
