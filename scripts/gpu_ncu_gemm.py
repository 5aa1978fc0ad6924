"""One bf16 GEMM launch at 4096^3 for Nsight Compute: where an mma.sync GEMM spends the H200.

    ncu --profile-from-start off --section SpeedOfLight --section ComputeWorkloadAnalysis \\
        --section MemoryWorkloadAnalysis --section WarpStateStats \\
        python scripts/gpu_ncu_gemm.py cute        # or: mma, wgmma, cublas

The kernel runs a few times first (compilation, module load, cuBLAS heuristics), then once
between cudaProfilerStart/Stop, so ``--profile-from-start off`` keeps exactly that launch.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tkit.cuda_ext.gemm import matmul_mma, matmul_wgmma  # noqa: E402
from tkit.cuda_ext.gemm_cute import matmul_cute_sm80  # noqa: E402


def main():
    which = sys.argv[1] if len(sys.argv) > 1 else "cute"
    n = int(sys.argv[2]) if len(sys.argv) > 2 else 4096
    torch.manual_seed(0)
    a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    fns = {
        "cute": lambda: matmul_cute_sm80(a, b, variant="128x256k64s3"),
        "mma": lambda: matmul_mma(a, b),
        "wgmma": lambda: matmul_wgmma(a, b),
        "cublas": lambda: a @ b,
    }
    fn = fns[which]
    for _ in range(3):
        out = fn()
    torch.cuda.synchronize()
    err = ((out.float() - (a.float() @ b.float())).norm() / (a.float() @ b.float()).norm())
    print(f"{which} {n}^3: relative error {err.item():.2e}", flush=True)
    torch.cuda.cudart().cudaProfilerStart()
    fn()
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStop()


if __name__ == "__main__":
    main()
