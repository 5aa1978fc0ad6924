"""Timing with CUDA events: medians, L2 flushed between runs, optional CUDA-graph replay."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass


@dataclass(frozen=True)
class Timing:
    median_ms: float
    p20_ms: float
    p80_ms: float


def time_fn(fn: Callable[[], object], *, warmup_ms: int = 25, rep_ms: int = 100,
            cuda_graph: bool = False, replay: bool = False) -> Timing:
    """Median, 20th and 80th percentile of ``fn()``'s device time.

    ``triton.testing.do_bench`` records CUDA events around each call and zeroes a 256 MB buffer
    between calls, so every run starts with a cold L2 (inputs are read from HBM, as they would be
    in a model). With ``cuda_graph`` the calls are captured once and replayed, which removes the
    launch gaps that dominate microsecond-scale kernels (the L2 is not flushed then).
    """
    import triton.testing

    q = [0.5, 0.2, 0.8]
    if cuda_graph:
        import torch

        with torch.cuda.stream(torch.cuda.Stream()):
            med, p20, p80 = triton.testing.do_bench_cudagraph(fn, rep=rep_ms, quantiles=q)
    else:
        if replay:
            fn = _captured(fn)
        med, p20, p80 = triton.testing.do_bench(fn, warmup=warmup_ms, rep=rep_ms, quantiles=q)
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
