"""What the kernels ask of the device, one answer each: SM count, shared-memory limit, compute
capability, TMA eligibility and the TMA scratch allocator.

Off the GPU there is one default for each. Meta tensors (``tkit.ir`` compiles for sm_90 without
a GPU) are planned as the H200: sm_90, 132 SMs, so that tkit.ir shows the GPU's choices. CPU
tensors (Triton's interpreter) are a small machine: 4 SMs, so that tests see multi-program
splits on tiny inputs; capability (0, 0), so that no Hopper-only path is taken.
"""

from __future__ import annotations

import contextlib
import functools

import torch

#: meta tensors: the H200
META_SMS = 132
META_CAPABILITY = (9, 0)
#: CPU tensors (the interpreter)
CPU_SMS = 4
CPU_CAPABILITY = (0, 0)
#: shared memory a block may use on sm_90 (227 KiB); the Gluon kernels plan against it
SM90_SMEM_LIMIT = 232448
#: no GPU: nothing to prune configs against
NO_SMEM_LIMIT = 1 << 30


def _index(device: torch.device) -> int:
    return device.index if device.index is not None else torch.cuda.current_device()


@functools.cache
def _props(index: int):
    return torch.cuda.get_device_properties(index)


def sm_count(device: torch.device) -> int:
    """SMs of ``device``; :data:`META_SMS` for meta tensors, :data:`CPU_SMS` on the CPU."""
    if device.type == "cuda":
        return _props(_index(device)).multi_processor_count
    return META_SMS if device.type == "meta" else CPU_SMS


def capability(device: torch.device | None = None) -> tuple[int, int]:
    """(major, minor) compute capability; ``None``: the current CUDA device."""
    if device is None or device.type == "cuda":
        p = _props(torch.cuda.current_device() if device is None else _index(device))
        return p.major, p.minor
    return META_CAPABILITY if device.type == "meta" else CPU_CAPABILITY


_assumed_smem: list = []


@contextlib.contextmanager
def assume_smem_limit(limit: int | None):
    """:func:`smem_limit` answers ``limit`` inside (None: unchanged). ``tkit.ir`` compiles for
    a named arch with it, so that the configs pruned by shared memory are the target's."""
    if limit is None:
        yield
        return
    _assumed_smem.append(limit)
    try:
        yield
    finally:
        _assumed_smem.pop()


def smem_limit() -> int:
    """Shared memory per block on the current CUDA device (opt-in maximum), else
    :data:`NO_SMEM_LIMIT`; the limit of :func:`assume_smem_limit` where one is in force."""
    if _assumed_smem:
        return _assumed_smem[-1]
    try:
        import triton

        dev = torch.cuda.current_device()
        props = triton.runtime.driver.active.utils.get_device_properties(dev)
        return int(props["max_shared_mem"])
    except Exception:  # no GPU: nothing to prune against
        return NO_SMEM_LIMIT


# --------------------------------------------------------------------------------------------
# TMA
# --------------------------------------------------------------------------------------------
def aligned16(t: torch.Tensor) -> bool:
    """Whether ``t``'s first element is 16-byte aligned. A meta tensor (tkit.ir) has no address:
    its storage is taken as aligned (as allocations are) and its view's offset decides."""
    if t.device.type == "meta":
        return (t.storage_offset() * t.element_size()) % 16 == 0
    return t.data_ptr() % 16 == 0


def tma_ok(*tensors: torch.Tensor) -> bool:
    """Can these tensors be read through tensor descriptors as they are (no transposition)?
    TMA needs the innermost stride 1, the other strides and the base 16-byte aligned."""
    for t in tensors:
        es = t.element_size()
        if t.stride(-1) != 1 or t.data_ptr() % 16:
            return False
        if any((st * es) % 16 for st in t.stride()[:-1]):
            return False
    return True


def _tma_alloc(size: int, alignment: int, stream):
    return torch.empty(size, device="cuda" if torch.cuda.is_available() else "cpu",
                       dtype=torch.int8)


def ensure_tma_allocator() -> None:
    """Device-side tensor descriptors need a little global scratch per program: give Triton
    an allocator for it. Triton keeps the allocator in a ContextVar, so each thread (autograd
    runs backward on its own threads, servers call from pools) starts without one: checked
    per call (a ContextVar read), set where missing."""
    from triton.runtime import _allocation

    if _allocation._allocator.get() is _allocation._NULL_ALLOCATOR:
        _allocation._allocator.set(_tma_alloc)
