"""The cost of an op (bytes and FLOPs it must move and do), below both the kernels, whose
``cost(...)`` functions build it, and the registry, whose specs and benchmarks read it."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Cost:
    """The least work an op must do: bytes through device memory (each input read once, each
    output written once) and floating-point operations."""

    bytes: float
    flops: float = 0.0

    @property
    def intensity(self) -> float:
        return self.flops / self.bytes if self.bytes else float("inf")


def unique_bytes(t: torch.Tensor) -> int:
    """Bytes an op must read from ``t``: broadcast (stride-0) dimensions count once."""
    n = 1
    for size, stride in zip(t.shape, t.stride()):
        if stride != 0:
            n *= size
    return n * t.element_size() if t.numel() else 0
