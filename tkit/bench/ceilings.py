"""The device's ceilings, measured by tkit on the device itself and cached.

* copy bandwidth: a 1 GiB bfloat16 device-to-device copy, counting bytes read plus written
  (the most a memory-bound kernel can reach);
* bf16 tensor-core rate: an 8192^3 bfloat16 matmul through cuBLAS (torch.matmul) on random data
  (zeros run faster and would overstate the ceiling).

Cached per (device name, torch version) under TKIT_CACHE_DIR; ``tkit bench --remeasure``
measures again.
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass

from tkit import _env


@dataclass(frozen=True)
class Ceilings:
    device: str
    copy_tbps: float
    bf16_tflops: float
    measured_at: str
    torch: str

    def floor_ms(self, bytes_: float, flops: float) -> float:
        """The roofline's least time for this much traffic and arithmetic."""
        t_mem = bytes_ / (self.copy_tbps * 1e12) * 1e3
        t_math = flops / (self.bf16_tflops * 1e12) * 1e3
        return max(t_mem, t_math)


def _cache_path(device_name: str, torch_version: str):
    slug = "".join(c if c.isalnum() else "-" for c in f"{device_name}-{torch_version}")
    return _env.CACHE_DIR / f"ceilings-{slug}.json"


def measure() -> Ceilings:
    import torch

    from tkit.bench.timing import time_fn

    dev = torch.cuda.get_device_name()
    n = (1 << 30) // 2
    src = torch.randn(n, device="cuda", dtype=torch.bfloat16)
    dst = torch.empty_like(src)
    copy_ms = time_fn(lambda: dst.copy_(src), rep_ms=200).median_ms
    copy_tbps = 2 * src.numel() * src.element_size() / (copy_ms * 1e-3) / 1e12
    k = 8192
    a = torch.randn(k, k, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(k, k, device="cuda", dtype=torch.bfloat16)
    mm_ms = time_fn(lambda: a @ b, rep_ms=300).median_ms
    tflops = 2 * k**3 / (mm_ms * 1e-3) / 1e12
    return Ceilings(dev, round(copy_tbps, 3), round(tflops, 1),
                    time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), torch.__version__)


def get(remeasure: bool = False) -> Ceilings:
    """Cached ceilings of the current GPU, measured on first use."""
    import torch

    path = _cache_path(torch.cuda.get_device_name(), torch.__version__)
    if path.exists() and not remeasure:
        return Ceilings(**json.loads(path.read_text()))
    c = measure()
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(asdict(c), indent=1))
    return c


def cached() -> Ceilings | None:
    """Ceilings measured earlier on this GPU, without measuring (None if never measured)."""
    import torch

    if not torch.cuda.is_available():
        return None
    path = _cache_path(torch.cuda.get_device_name(), torch.__version__)
    return Ceilings(**json.loads(path.read_text())) if path.exists() else None
