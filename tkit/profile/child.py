"""The program ``tkit profile`` runs under Nsight Compute: one benchmark case of a registered
op, called until compiled and warm, then once inside the NVTX range ``tkit_profile`` (the
only kernels ncu profiles).

    python -m tkit.profile.child OP [CASE]
"""

from __future__ import annotations

import sys

import torch

#: the NVTX range around the profiled call
RANGE = "tkit_profile"


def main(argv: list[str]) -> int:
    from tkit import registry

    op, case = argv[0], int(argv[1]) if len(argv) > 1 else 0
    spec = registry.get(op)
    args, kwargs = list(spec.bench_cases())[case].make("cuda")
    for _ in range(3):  # compiles, plans, caches
        spec.fn(*args, **kwargs)
    torch.cuda.synchronize()
    with torch.cuda.nvtx.range(RANGE):
        spec.fn(*args, **kwargs)
    torch.cuda.synchronize()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
