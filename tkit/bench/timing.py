"""Timing with CUDA events: medians, the L2 made cold before each run, optional CUDA-graph
replay."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

#: bytes read (or written) before each timed run: over 4x the H200's 60 MB L2
FLUSH_BYTES = 256 * 1024 * 1024
#: GPU clock cycles of the spin queued ahead of each run (~100 us at the H200's clocks), so
#: that the host has enqueued the run before the device reaches it: device time only
HEAD_START_CYCLES = 200_000
L2_MODES = ("read", "write")


@dataclass(frozen=True)
class Timing:
    median_ms: float
    p20_ms: float
    p80_ms: float


def round_order(names: list, r: int, rounds: int | None = None) -> list:
    """The order round ``r`` of ``rounds`` (default len(names)) times ``names`` in: rotated by
    r * len(names) // rounds, so that the rounds spread each name over the positions (over
    len(names) rounds, each takes every position once). Interleaving alone leaves each name
    at one position in every round, and the position is not neutral: identical kernels in
    different slots of one round have differed by up to 5% on the H200 (docs/NOTES.md)."""
    n = len(names)
    k = (r * n // (rounds or n or 1)) % n if n else 0
    return list(names[k:]) + list(names[:k])


def time_fn(fn: Callable[[], object], *, warmup_ms: int = 25, rep_ms: int = 100,
            cuda_graph: bool = False, replay: bool = False, l2: str = "read") -> Timing:
    """Median, 20th and 80th percentile of ``fn()``'s device time.

    Before each timed call the L2 is made cold by streaming a 256 MB buffer through it, so
    inputs are read from HBM as they would be in a model. ``l2="read"`` (the default) reads
    the buffer: the L2 is left holding clean lines, which the timed call evicts for free.
    ``l2="write"`` zeroes it, as ``triton.testing.do_bench`` does: the L2 is then full of
    dirty lines that the timed call's own reads evict, so a call that reads less than ~4x the
    L2 pays for writing up to 60 MB back to HBM on top of its own traffic (a 31 MB INT4 GEMV
    looks up to twice as slow; docs/NOTES.md has both modes measured side by side). Each run
    is also queued behind a ~100 us spin of the GPU, so the host's launch path of ``fn`` does
    not show in the device time (``tkit bench --group latency`` measures that separately).

    With ``cuda_graph`` the calls are captured once and replayed back to back, which removes
    the launch gaps that dominate microsecond-scale kernels (the L2 is not flushed then);
    ``replay`` captures ``fn`` in a graph and times single replays as above.
    """
    import torch

    if l2 not in L2_MODES:
        raise ValueError(f"l2={l2!r} must be one of {L2_MODES}")
    q = [0.5, 0.2, 0.8]
    if cuda_graph:
        import triton.testing

        with torch.cuda.stream(torch.cuda.Stream()):
            med, p20, p80 = triton.testing.do_bench_cudagraph(fn, rep=rep_ms, quantiles=q)
        return Timing(float(med), float(p20), float(p80))
    if replay:
        fn = _captured(fn)
    buf = torch.empty(FLUSH_BYTES // 4, dtype=torch.int32, device="cuda")
    buf.fill_(1)
    flush = (lambda: buf.sum()) if l2 == "read" else buf.zero_

    fn()
    torch.cuda.synchronize()
    start = torch.cuda.Event(enable_timing=True)
    end = torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(5):
        fn()
    end.record()
    torch.cuda.synchronize()
    estimate_ms = max(start.elapsed_time(end) / 5, 1e-3)
    start.record()
    torch.cuda._sleep(HEAD_START_CYCLES)
    flush()
    end.record()
    torch.cuda.synchronize()
    # the repetitions fill rep_ms with the flush and the spin counted, as do_bench's do
    n_warmup = max(1, int(warmup_ms / estimate_ms))
    n_repeat = max(1, int(rep_ms / (estimate_ms + start.elapsed_time(end))))
    for _ in range(n_warmup):
        fn()
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(n_repeat)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(n_repeat)]
    for i in range(n_repeat):
        torch.cuda._sleep(HEAD_START_CYCLES)
        flush()
        starts[i].record()
        fn()
        ends[i].record()
    torch.cuda.synchronize()
    times = torch.tensor([s.elapsed_time(e) for s, e in zip(starts, ends)], dtype=torch.float64)
    med, p20, p80 = torch.quantile(times, torch.tensor(q, dtype=torch.float64)).tolist()
    return Timing(float(med), float(p20), float(p80))


def _captured(fn: Callable[[], object]) -> Callable[[], object]:
    """``fn`` captured once in a CUDA graph (after a warm-up call on the capture stream); the
    returned callable replays it."""
    import torch

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.stream(stream):
        fn()
        stream.synchronize()
        with torch.cuda.graph(graph, stream=stream):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    return graph.replay
