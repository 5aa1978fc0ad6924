"""Timing with CUDA events (or the kernels' own device time): medians, the L2 made cold before
each run, optional CUDA-graph replay."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

#: bytes read (or written) before each timed run: over 4x the H200's 60 MB L2
FLUSH_BYTES = 256 * 1024 * 1024
#: GPU clock cycles of the spin queued ahead of each run (~400 us at the H200's clocks; with
#: the flush, ~460 us before the run starts), so that the host has enqueued the run before
#: the device reaches it: device time only. Eager calls whose host path is longer (a
#: torch.compile'd layer, a library that builds its launch in Python) would otherwise show
#: the host's time (docs/NOTES.md, thirty-second session)
HEAD_START_CYCLES = 800_000
L2_MODES = ("read", "write")
#: "events": CUDA events around each run; "kernels": the span of the run's kernels on the
#: device (first start to last end, from the profiler's CUPTI records)
TIMERS = ("events", "kernels")


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
            cuda_graph: bool = False, replay: bool = False, l2: str = "read",
            timer: str = "events") -> Timing:
    """Median, 20th and 80th percentile of ``fn()``'s device time.

    Before each timed call the L2 is made cold by streaming a 256 MB buffer through it, so
    inputs are read from HBM as they would be in a model. ``l2="read"`` (the default) reads
    the buffer: the L2 is left holding clean lines, which the timed call evicts for free.
    ``l2="write"`` zeroes it, as ``triton.testing.do_bench`` does: the L2 is then full of
    dirty lines that the timed call's own reads evict, so a call that reads less than ~4x the
    L2 pays for writing up to 60 MB back to HBM on top of its own traffic (a 31 MB INT4 GEMV
    looks up to twice as slow; docs/NOTES.md has both modes measured side by side). Each run
    is also queued behind a ~400 us spin of the GPU, so the host's launch path of ``fn`` does
    not show in the device time (``tkit bench --group latency`` measures that separately).

    With ``cuda_graph`` the calls are captured once and replayed back to back, which removes
    the launch gaps that dominate microsecond-scale kernels (the L2 is not flushed then);
    ``replay`` captures ``fn`` in a graph and times single replays as above.

    ``timer="kernels"`` times the same runs (spin, flush, call) by the device time of the
    call's own kernels, copies and fills: from the first one's start to the last one's end,
    as the profiler's CUPTI records give them. The events' time adds what a stream spends
    around a run (the event records, the front end reaching the first kernel: ~3.5 us on
    the H200, docs/NOTES.md), which is most of the time of a call of a few microseconds and
    none of its kernels'.
    """
    import torch

    if l2 not in L2_MODES:
        raise ValueError(f"l2={l2!r} must be one of {L2_MODES}")
    if timer not in TIMERS:
        raise ValueError(f"timer={timer!r} must be one of {TIMERS}")
    if timer == "kernels" and cuda_graph:
        raise ValueError("timer='kernels' times single runs; it does not go with cuda_graph")
    q = [0.5, 0.2, 0.8]
    if cuda_graph:
        import triton.testing

        with torch.cuda.stream(torch.cuda.Stream()):
            med, p20, p80 = triton.testing.do_bench_cudagraph(fn, rep=rep_ms, quantiles=q)
        return Timing(float(med), float(p20), float(p80))
    if replay:
        fn = _captured(fn)
    # float32: the sum of an int32 buffer is int64, which torch forms by writing an int64
    # copy of the whole buffer first (twice its bytes written, then read)
    buf = torch.ones(FLUSH_BYTES // 4, dtype=torch.float32, device="cuda")
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
    if timer == "kernels":
        ms = _kernel_spans(fn, flush, n_repeat)
    else:
        starts = [torch.cuda.Event(enable_timing=True) for _ in range(n_repeat)]
        ends = [torch.cuda.Event(enable_timing=True) for _ in range(n_repeat)]
        for i in range(n_repeat):
            torch.cuda._sleep(HEAD_START_CYCLES)
            flush()
            starts[i].record()
            fn()
            ends[i].record()
        torch.cuda.synchronize()
        ms = [s.elapsed_time(e) for s, e in zip(starts, ends)]
    times = torch.tensor(ms, dtype=torch.float64)
    med, p20, p80 = torch.quantile(times, torch.tensor(q, dtype=torch.float64)).tolist()
    return Timing(float(med), float(p20), float(p80))


def _kernel_spans(fn: Callable[[], object], flush, n: int) -> list[float]:
    """``n`` runs of (spin, flush, ``fn``) under the profiler; each run's span in ms."""
    import torch
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    def device_events(prof):
        return sorted((e.time_range.start, e.time_range.end, e.name) for e in prof.events()
                      if e.device_type == DeviceType.CUDA)

    # what the spin and the flush alone put on the device: their records open each run
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        torch.cuda._sleep(HEAD_START_CYCLES)
        flush()
        torch.cuda.synchronize()
    lead = device_events(prof)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(n):
            torch.cuda._sleep(HEAD_START_CYCLES)
            flush()
            fn()
        torch.cuda.synchronize()
    return run_spans(device_events(prof), [name for _, _, name in lead], n)


def run_spans(events: list, lead: list, n: int) -> list[float]:
    """Each run's span in ms from the device records (start us, end us, name) of ``n`` runs,
    sorted by start, where each run opens with records named as ``lead`` (the spin and the
    flush) and goes on with the timed call's. Raises when the records do not split so (a
    call whose work is on another stream, or none on the device)."""
    if not lead:
        raise RuntimeError("timer='kernels': the spin and the flush left no device records")
    starts = [i for i in range(len(events) - len(lead) + 1)
              if all(events[i + j][2] == name for j, name in enumerate(lead))]
    # a call could hold records of the same names: keep the starts that follow one whole run
    opens = []
    for i in starts:
        if not opens or i >= opens[-1] + len(lead) + 1:
            opens.append(i)
    if len(opens) != n:
        raise RuntimeError(f"timer='kernels': found {len(opens)} runs in the device records, "
                           f"expected {n}")
    spans = []
    for k, i in enumerate(opens):
        end = opens[k + 1] if k + 1 < len(opens) else len(events)
        own = events[i + len(lead):end]
        if not own:
            raise RuntimeError("timer='kernels': a run of the call left no device record")
        spans.append((max(e for _, e, _ in own) - min(s for s, _, _ in own)) / 1e3)
    return spans


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
