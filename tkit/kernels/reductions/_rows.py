"""Row helpers shared by the reductions family's kernels and launchers."""

from __future__ import annotations

import torch
import triton
import triton.language as tl


def as_rows(t: torch.Tensor) -> torch.Tensor:
    """``t`` as an (M, N) view over its last dimension (rows may be strided; the column stride is
    passed to the kernels). Leading dimensions that do not merge into one row stride are copied.
    """
    N = t.shape[-1]
    try:
        return t.view(-1, N)
    except RuntimeError:
        return t.reshape(-1, N)


@triton.jit
def _row_offsets(pid, M, ROWS: tl.constexpr, INT64: tl.constexpr):
    rows = pid * ROWS + tl.arange(0, ROWS)
    if INT64:
        rows = rows.to(tl.int64)
    return rows, rows < M

