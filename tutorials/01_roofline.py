# %% [markdown]
# # 01. The hardware and the roofline: how fast should it be?
#
# Before writing a kernel, compute two numbers: the least time its memory traffic can take and
# the least time its arithmetic can take. The larger one is the floor no implementation beats.
#
#     t_memory = bytes moved through HBM / copy bandwidth
#     t_math   = floating-point operations / tensor-core (or CUDA-core) rate
#
# Both ceilings are *measured*, on the device, by tkit itself (`tkit.bench.ceilings`): a 1 GiB
# bfloat16 device-to-device copy counting bytes read plus written, and an 8192^3 bfloat16
# matmul through cuBLAS on random data. Datasheet numbers are leads, not ceilings.
#
# Run it: `python tutorials/01_roofline.py` on a GPU measures the ceilings; `pytest tutorials`
# checks the arithmetic on any machine.

# %%
from __future__ import annotations

import json
from pathlib import Path

import torch

from tkit.registry import Cost

RESULTS = Path(__file__).resolve().parents[1] / "benchmarks" / "results"


def recorded_ceilings() -> dict | None:
    """The ceilings of the last recorded H200 run (used where there is no GPU): the last row
    with op ``ceilings`` in the long-form file benchmarks/results/h200.jsonl."""
    path = RESULTS / "h200.jsonl"
    rows = [json.loads(ln) for ln in path.read_text().splitlines() if ln.strip()] \
        if path.exists() else []
    rec = [r for r in rows if r.get("op") == "ceilings"]
    return rec[-1] if rec else None


# %% [markdown]
# ## Arithmetic intensity
#
# Intensity = FLOPs / bytes. The roofline's *ridge point* is peak FLOP/s over bandwidth: below
# it a kernel is memory-bound, above it compute-bound. On the H200, with ~4.25 TB/s of copy
# bandwidth and ~680-720 TFLOP/s of bf16 matmul, the ridge sits near 160-170 FLOP/byte.


# %%
def add_cost(n: int, itemsize: int = 2) -> Cost:
    """c = a + b: read a and b, write c; one FLOP per element."""
    return Cost(bytes=3 * n * itemsize, flops=n)


def gemm_cost(m: int, n: int, k: int, itemsize: int = 2) -> Cost:
    """C = A @ B: read A (m*k) and B (k*n) once, write C (m*n); 2*m*n*k FLOPs."""
    return Cost(bytes=(m * k + k * n + m * n) * itemsize, flops=2 * m * n * k)


def floor_ms(cost: Cost, tbps: float, tflops: float) -> tuple[float, float]:
    return cost.bytes / (tbps * 1e12) * 1e3, cost.flops / (tflops * 1e12) * 1e3


# %% [markdown]
# An elementwise add of two 16384 x 8192 bf16 tensors moves 768 MiB and does 134M FLOPs:
# intensity 1/6 FLOP per byte, a thousand times under the ridge. Its floor is the copy time.
# A 4096^3 bf16 GEMM moves 96 MiB (each operand once) and does 137 GFLOP: 1365 FLOP per byte,
# eight times over the ridge. Its floor is the matmul rate. The same chip, two different
# ceilings: every benchmark in tkit reports "% of roofline" against the right one.


# %%
def test_add_is_memory_bound_and_gemm_compute_bound():
    ridge = 700 / 4.25  # FLOP/byte
    add, gemm = add_cost(16384 * 8192), gemm_cost(4096, 4096, 4096)
    assert abs(add.intensity - 1 / 6) < 1e-12
    assert abs(gemm.intensity - 2 * 4096**3 / (3 * 4096**2 * 2)) < 1e-9
    assert add.intensity < ridge < gemm.intensity


def test_tkit_cost_models_agree_with_the_hand_count():
    """The registry's cost function for add is the one counted here by hand (and a
    broadcast operand is read once, not once per use)."""
    from tkit import registry

    a = torch.empty(64, 32, device="meta", dtype=torch.bfloat16)
    b = torch.empty(64, 32, device="meta", dtype=torch.bfloat16)
    assert registry.get("add").cost(a, b) == add_cost(64 * 32)
    row = torch.empty(32, device="meta", dtype=torch.bfloat16)
    assert registry.get("add").cost(a, row).bytes == (2 * 64 * 32 + 32) * 2


def test_floors():
    t_mem, t_math = floor_ms(add_cost(16384 * 8192), 4.25, 700)
    assert t_mem > 100 * t_math  # add: memory time dominates
    t_mem, t_math = floor_ms(gemm_cost(4096, 4096, 4096), 4.25, 700)
    assert t_math > 5 * t_mem  # GEMM: math time dominates


# %% [markdown]
# ## Measuring the ceilings
#
# On a GPU this measures both ceilings (a few seconds) and prints the floors of the two
# examples. On the H200 of 2026-11-29 (run `h200-2026-11-29-b`, benchmarks/results/RUNS.md) it
# printed: copy 4.22 TB/s, bf16 matmul 703 TFLOP/s, ridge 166 FLOP/byte; the add's floor
# 0.1907 ms (memory-bound), the 4096^3 GEMM's 0.1955 ms (compute-bound). Chapter 02 measures an
# add at 0.189 ms: on its floor.

# %%
if __name__ == "__main__":
    if torch.cuda.is_available():
        from tkit.bench import ceilings

        c = ceilings.measure()
        bw, peak, source = c.copy_tbps, c.bf16_tflops, f"measured now on {c.device}"
    else:
        rec = recorded_ceilings()
        if rec is None:
            raise SystemExit("no GPU and no recorded run under benchmarks/results/")
        bw, peak = rec["copy_tbps"], rec["bf16_tflops"]
        source = f"recorded on {rec['device']} ({rec['measured_at']}); no GPU here"
    print(f"ceilings ({source}): copy {bw:.2f} TB/s, bf16 matmul {peak:.0f} TFLOP/s, "
          f"ridge {peak / bw:.0f} FLOP/byte")
    for name, cost in [("add 16384x8192 bf16", add_cost(16384 * 8192)),
                       ("GEMM 4096^3 bf16", gemm_cost(4096, 4096, 4096))]:
        t_mem, t_math = floor_ms(cost, bw, peak)
        bound = "memory" if t_mem > t_math else "compute"
        print(f"{name:<22} intensity {cost.intensity:8.2f} FLOP/B  t_mem {t_mem:.4f} ms  "
              f"t_math {t_math:.4f} ms  -> {bound}-bound, floor {max(t_mem, t_math):.4f} ms")
