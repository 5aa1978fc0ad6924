"""``diagnose(kernel)``: the decision tree from one kernel's Nsight Compute metrics to what
bounds it and what to try, in the order a reader of chapters 01-08 asks: does the grid fill
the GPU, which unit is the limit (memory, math, or neither: latency), and if neither, why the
warps wait."""

from __future__ import annotations

from dataclasses import dataclass

#: a unit busier than this share of its peak bounds the kernel
BOUND_PCT = 60.0
#: past this share of DRAM's peak a memory-bound kernel is at its roofline
ROOFLINE_PCT = 85.0
#: achieved occupancy below this share of the SM's warps leaves latency uncovered
LOW_OCCUPANCY_PCT = 25.0

#: what a dominant stall reason means and what to try (the chapters that show it)
STALL_ADVICE = {
    "long_scoreboard": "waiting on global memory loads: more bytes in flight (more pipeline "
                       "stages, more programs an SM, wider vector loads), or TMA (chapter 06)",
    "barrier": "waiting at __syncthreads / tl barriers: fewer block-wide syncs, warp "
               "specialization so producers and consumers do not wait in lockstep (chapter 08)",
    "mio_throttle": "the shared-memory / special-function queue is full: fewer, wider "
                    "shared-memory accesses, fewer bank conflicts (chapter 05)",
    "lg_throttle": "the local/global memory queue is full: fewer, wider (16-byte) global "
                   "accesses, no spills to local memory (chapter 03)",
    "short_scoreboard": "waiting on shared memory or special functions (exp, rsqrt): "
                        "exp2 with a folded scale, fewer shared-memory round trips",
    "math_pipe_throttle": "a math pipe is saturated: the kernel is compute-bound on that "
                          "pipe; move the work to tensor cores or cut instructions",
    "wait": "fixed-latency dependencies: more independent work a thread (unrolling, "
            "more rows a program)",
    "membar": "memory barriers (atomics, fences): fewer of them, or a reduction without "
              "atomics",
    "tex_throttle": "the texture / L1 pipe is full: fewer L1 accesses a byte",
    "no_instruction": "the instruction cache misses: a smaller kernel (less unrolling)",
    "branch_resolving": "divergent branches: uniform control flow",
    "dispatch_stall": "the dispatcher stalls: usually a pipe conflict",
    "drain": "stores draining at exit: normal for short kernels",
    "imc_miss": "the constant cache misses: fewer distinct constants",
    "sleeping": "warps sleeping (nanosleep / warp sync)",
}


@dataclass(frozen=True)
class Finding:
    """One step of the tree: ``kind`` is "grid", "bound", "occupancy", "stall" or "note"."""

    kind: str
    text: str


def diagnose(k: dict) -> list[Finding]:
    """Findings for kernel ``k`` (a row of :func:`tkit.profile.metrics.parse_raw_csv`)."""
    out: list[Finding] = []
    grid, sms = k.get("grid"), k.get("sms")
    if grid is not None and sms:
        if grid < sms:
            out.append(Finding("grid", f"the grid has {grid:.0f} programs for {sms:.0f} SMs: "
                               f"{sms - grid:.0f} SMs idle; split the work (split-K, split-KV, "
                               "smaller tiles) so every SM has a program"))
        else:
            waves = grid / sms
            tail = waves - int(waves)
            if 1 < waves < 4 and 0 < tail < 0.5:
                out.append(Finding("grid", f"{waves:.2f} waves of programs a SM: the last wave "
                                   f"runs {tail:.0%} full; a persistent grid or another tile "
                                   "size evens it"))
    dram, sm = k.get("dram_pct"), k.get("sm_pct")
    tensor = max(k.get("tensor_pct") or 0.0, k.get("gmma_pct") or 0.0)
    if dram is not None and dram >= BOUND_PCT and dram >= (sm or 0.0):
        if dram >= ROOFLINE_PCT:
            out.append(Finding("bound", f"memory-bound at {dram:.0f}% of DRAM's peak: at the "
                               "roofline; only fewer bytes help (fusion, a smaller dtype, "
                               "reading each byte once)"))
        else:
            out.append(Finding("bound", f"memory-bound at {dram:.0f}% of DRAM's peak: more "
                               "bytes in flight (stages, programs an SM, 16-byte loads, TMA)"))
        return out + _stalls(k, 2)
    if sm is not None and sm >= BOUND_PCT:
        if tensor >= BOUND_PCT:
            out.append(Finding("bound", f"compute-bound on the tensor cores ({tensor:.0f}% of "
                               "their peak): larger tiles, fewer non-MMA instructions in the "
                               "loop, fp8"))
        else:
            out.append(Finding("bound", f"compute-bound at {sm:.0f}% of the SM's peak with the "
                               f"tensor cores at {tensor:.0f}%: the math runs on the CUDA "
                               "cores; a tl.dot / wgmma formulation, or fewer instructions"))
        return out + _stalls(k, 2)
    out.append(Finding("bound", f"latency-bound: DRAM at {dram or 0:.0f}% and the SM at "
                       f"{sm or 0:.0f}% of their peaks, neither a limit; the warps wait"))
    occ, limit = k.get("occupancy_pct"), k.get("occupancy_limit_pct")
    if occ is not None and occ < LOW_OCCUPANCY_PCT:
        why = ""
        if limit is not None and limit < LOW_OCCUPANCY_PCT * 2:
            regs = k.get("registers")
            why = (f" (at most {limit:.0f}% by the launch: {regs:.0f} registers a thread, "
                   f"{(k.get('shared_bytes') or 0) / 1024:.0f} KB of shared memory a program)"
                   if regs is not None else f" (at most {limit:.0f}% by the launch)")
        out.append(Finding("occupancy", f"{occ:.0f}% of the SM's warps active{why}: too few "
                           "warps to hide latency; fewer registers or less shared memory a "
                           "program, or more work in flight a warp"))
    return out + _stalls(k, 3)


def _stalls(k: dict, n: int) -> list[Finding]:
    stalls = {r: v for r, v in (k.get("stalls") or {}).items() if r != "selected" and v > 0}
    total = sum(stalls.values())
    if not total:
        return []
    out = []
    for reason, v in sorted(stalls.items(), key=lambda kv: -kv[1])[:n]:
        advice = STALL_ADVICE.get(reason)
        out.append(Finding("stall", f"{reason}: {v / total:.0%} of the stalls ({v:.2f} "
                           "cycles an issued instruction)" + (f"; {advice}" if advice else "")))
    return out


def report(k: dict) -> str:
    """The findings for kernel ``k`` as text, with its time and name."""
    head = f"{k.get('kernel', '?')}: {k.get('duration_ns', 0) / 1e3:.1f} us"
    return "\n".join([head] + [f"  [{f.kind}] {f.text}" for f in diagnose(k)])
