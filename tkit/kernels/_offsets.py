"""Validation of index tensors (grouped_matmul's ``offsets``, varlen attention's ``cu_seqlens``).

Memory safety does not depend on it: the kernels clamp every offset to the tensors' extents, so
no value can make them read or write outside a tensor (see the kernels' docstrings for what rows
outside every segment get). What validation adds is a clear error instead of a defined but
meaningless result. Two levels:

* always, before anything launches: dtype, rank, device, number of entries; and the values
  themselves when reading them costs no device sync (the tensor is on the host, which is also
  the case when the kernels run on the CPU in Triton's interpreter);
* with ``TKIT_CHECK=1`` (:mod:`tkit._env`), the values of device tensors too (one sync a call).

Values are checked in order: the first entry is 0, each is in [0, total] and not smaller than
the one before, the last is total; the error names the argument and the first bad entry.
"""

from __future__ import annotations

import torch

from tkit import _env


def values_checked(t: torch.Tensor) -> bool:
    """Whether :func:`check_values` reads ``t``: on the host always, on a device under
    TKIT_CHECK=1; never while torch.compile traces (fake tensors hold no values) or for meta
    tensors (``tkit.ir`` compiles without data)."""
    if t.device.type == "meta" or torch.compiler.is_compiling():
        return False
    return t.device.type == "cpu" or _env.CHECK


def check_values(offsets: torch.Tensor, name: str, total: int, total_name: str,
                 max_len: int | None = None, max_len_name: str = "") -> None:
    """ValueError unless ``offsets`` is 0 = o[0] <= o[1] <= ... <= o[-1] = total, and (when
    ``max_len`` is given) no segment o[i+1] - o[i] is longer than ``max_len``."""
    vals = offsets.tolist()
    if not vals:
        return
    if vals[0] != 0:
        raise ValueError(f"{name}[0] = {vals[0]}: the first offset must be 0")
    for i in range(1, len(vals)):
        v = vals[i]
        if v < 0 or v > total:
            raise ValueError(f"{name}[{i}] = {v} is outside [0, {total_name} = {total}]")
        if v < vals[i - 1]:
            raise ValueError(f"{name}[{i}] = {v} is smaller than {name}[{i - 1}] = "
                             f"{vals[i - 1]}: offsets must be non-decreasing")
        if max_len is not None and v - vals[i - 1] > max_len:
            raise ValueError(f"{name}[{i}] - {name}[{i - 1}] = {v - vals[i - 1]} tokens, more "
                             f"than {max_len_name} = {max_len}")
    if vals[-1] != total:
        raise ValueError(f"{name}[{len(vals) - 1}] = {vals[-1]} but {total_name} = {total}: "
                         f"the last offset must equal it (every row in a segment)")
