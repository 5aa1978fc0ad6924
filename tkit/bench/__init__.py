"""Benchmark harness: CUDA-event medians with L2 flushed, device ceilings measured on the device,
baselines interleaved in the same run, roofline percentages, JSON + markdown + plot reports.

    from tkit.bench import time_fn
    t = time_fn(lambda: tkit.rms_norm(x, w))      # Timing(median_ms, p20_ms, p80_ms)
"""

from tkit.bench.ceilings import Ceilings
from tkit.bench.ceilings import get as get_ceilings
from tkit.bench.timing import Timing, time_fn

__all__ = ["Ceilings", "Timing", "get_ceilings", "time_fn"]
