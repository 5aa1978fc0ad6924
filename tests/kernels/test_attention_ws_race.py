"""The warp-specialized Hopper attention forward under racecheck, and a test that would catch a
real race in it.

``compute-sanitizer --tool racecheck`` reports hazards in ``_attn_fwd_hopper_ws_kernel`` at the
kernel's first line and at its ``gl.warp_specialize`` call: code that Triton's lowering writes,
not tkit's pipeline. That lowering hands the partitions their captured values and per-warp
state through shared memory; the default warpgroup stores them, then every thread of the CTA
meets at ``barrier.sync 1``; the workers read them, then every thread meets at
``barrier.sync 1`` again before anything else runs; at the end the exit state is stored between
two more CTA-wide barriers (docs/NOTES.md has the PTX). The ladder below found what brings
the reports (H200, 2026-12-01): a ``bar.sync 0, 128`` in the default partition before the
region, i.e. barrier 0 counted over 128 of the CTA's threads; every probe variant with it shows
hazards at the lowering's lines, every one without it none (``test_hazards_come_with_a_partial
_barrier_zero``). Hardware orders those accesses by the CTA-wide barriers; the partial barrier
is what racecheck's ordering gets wrong.

One run of this file bisects it: ``test_ws_racecheck_ladder`` runs racecheck over every
variant of ``ws_racecheck_probe.LADDER`` (each of tkit's features alone on the shaped minimal
kernel: mbarriers initialised before the region, 229 KB of shared memory below the lowering's
bytes, a CTA barrier before the region, a TMA load awaited on an mbarrier in a worker, tkit's
number of captured values; then those added one at a time; then tkit's kernel itself), a few
at once, and writes a table of hazards per variant to ``$OUT/ws-racecheck-ladder.txt`` (when
``OUT`` is set; also printed, and as JSON beside it). Every probe variant checks its own
output, so a variant that races visibly fails here. A race on tkit's captured values (a tile's
batch, head or first row) would show as a wrong or non-deterministic output, which the
100 repeated launches over many CTAs of ``test_ws_forward_is_deterministic_and_right`` would
catch.
"""

from __future__ import annotations

import collections
import concurrent.futures
import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

PROBE = Path(__file__).with_name("ws_racecheck_probe.py")
ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(PROBE.parent))
import ws_racecheck_probe as P  # noqa: E402

_SUMMARY = re.compile(r"RACECHECK SUMMARY: (\d+) hazards? displayed \((\d+) errors?, "
                      r"(\d+) warnings?\)")
_WHERE = re.compile(r"at (?:0x[0-9a-f]+ )?in \S*?([\w.]+\.py):(\d+)")
#: racecheck runs at once (each is one process on the one GPU, instrumented)
PARALLEL = 6


def _hopper():
    if not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("the warp-specialized forward runs on sm_90 only")
    from tkit.kernels.attention import hopper as H

    return H


@pytest.mark.gpu
@pytest.mark.parametrize("causal", [False, True])
def test_ws_forward_is_deterministic_and_right(causal):
    H = _hopper()

    g = torch.Generator(device="cuda").manual_seed(1)
    q, k, v = (torch.randn(2, 1000, 8, 128, device="cuda", dtype=torch.bfloat16, generator=g)
               for _ in range(3))
    cfg = H.config_dict(128, 3, True)
    first, lse = H.forward(q, k, v, causal, config=dict(cfg))
    ref = torch.nn.functional.scaled_dot_product_attention(
        *(t.float().transpose(1, 2) for t in (q, k, v)), is_causal=causal).transpose(1, 2)
    assert (first.float() - ref).abs().max().item() < 2e-2
    for _ in range(100):
        again, lse2 = H.forward(q, k, v, causal, config=dict(cfg))
        assert torch.equal(again, first) and torch.equal(lse2, lse)


def parse_racecheck(text: str) -> dict:
    """Counts from racecheck's summary (None when it is missing) and where the reports point
    (``file:line`` -> reports)."""
    m = _SUMMARY.search(text)
    hazards, errors, warnings = map(int, m.groups()) if m else (None, None, None)
    where = collections.Counter(f"{f}:{n}" for f, n in _WHERE.findall(text))
    return {"hazards": hazards, "errors": errors, "warnings": warnings, "where": dict(where)}


def _racecheck(exe: str, which: str) -> dict:
    env = dict(os.environ, PYTHONPATH=f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    t0 = time.time()
    try:
        out = subprocess.run([exe, "--tool", "racecheck", "--racecheck-report", "hazard",
                              sys.executable, str(PROBE), which], capture_output=True,
                             text=True, timeout=420, env=env)
        text, rc = out.stdout + out.stderr, out.returncode
        done = "done" in out.stdout
    except subprocess.TimeoutExpired as e:
        text = e.stdout.decode(errors="replace") if isinstance(e.stdout, bytes) else (
            e.stdout or "")
        rc, done = "timeout", False
    return {"variant": which, **parse_racecheck(text), "ran": done, "rc": rc,
            "seconds": round(time.time() - t0, 1), "tail": "" if done else text[-2000:]}


def ladder_table(results: list[dict]) -> str:
    """The table of hazards per variant, in ladder order."""
    lines = [f"{'variant':40s} {'hazards':>7s} {'errors':>6s} {'warns':>5s} {'ran':>4s} "
             f"{'secs':>6s}  where (file:line reports)"]
    for r in results:
        def cell(v):
            return "?" if v is None else str(v)

        where = ", ".join(f"{k} x{v}" for k, v in sorted(r["where"].items()))
        lines.append(f"{r['variant']:40s} {cell(r['hazards']):>7s} {cell(r['errors']):>6s} "
                     f"{cell(r['warnings']):>5s} {'yes' if r['ran'] else 'NO':>4s} "
                     f"{r['seconds']:>6.1f}  {where}")
    return "\n".join(lines)


@pytest.fixture(scope="module")
def ladder():
    """racecheck over every variant of the ladder, PARALLEL at once; the table written to
    $OUT/ws-racecheck-ladder.txt (and .json) and printed."""
    _hopper()
    exe = shutil.which("compute-sanitizer") or "/usr/local/cuda/bin/compute-sanitizer"
    if not os.path.exists(exe):
        pytest.skip("compute-sanitizer not found")
    with concurrent.futures.ThreadPoolExecutor(PARALLEL) as pool:
        results = list(pool.map(lambda v: _racecheck(exe, v), P.LADDER))
    table = ladder_table(results)
    print("\n" + table)
    out = os.environ.get("OUT")
    if out:
        Path(out).mkdir(parents=True, exist_ok=True)
        Path(out, "ws-racecheck-ladder.txt").write_text(table + "\n")
        Path(out, "ws-racecheck-ladder.json").write_text(json.dumps(results, indent=1))
    return {r["variant"]: r for r in results}


@pytest.mark.gpu
def test_ws_racecheck_ladder(ladder):
    """Every variant ran to its "done" (its output checked) under racecheck, and tkit's
    hazards sit only at its kernel's first line and its warp_specialize call."""
    H = _hopper()
    import inspect

    not_run = {v: r["tail"][-800:] for v, r in ladder.items() if not r["ran"]}
    assert not not_run, f"variants that did not finish under racecheck: {not_run}"
    assert all(r["hazards"] is not None for r in ladder.values())
    src, first = inspect.getsourcelines(H._attn_fwd_hopper_ws_kernel.fn)
    ws_line = first + next(i for i, s in enumerate(src) if "gl.warp_specialize(" in s)
    def_line = first + next(i for i, s in enumerate(src) if s.lstrip().startswith("def "))
    fname = Path(inspect.getsourcefile(H._attn_fwd_hopper_ws_kernel.fn)).name
    lines = {int(w.split(":")[1]) for w in ladder["tkit"]["where"]
             if w.startswith(fname + ":")}
    assert lines <= {def_line, ws_line}, (
        f"racecheck hazards in tkit's own code at attention/{fname} lines {sorted(lines)}")


def _partial_bar0(variant: str) -> bool:
    """Whether the variant's PTX has a barrier 0 over part of the CTA (``bar.sync 0, 128``:
    the default warpgroup's 128 of its 384 threads)."""
    return "bar.sync 0, 128" in P.compile_sm90(variant).asm["ptx"]


@pytest.mark.gpu
def test_hazards_come_with_a_partial_barrier_zero(ladder):
    """The finding of the ladder (H200, 2026-12-01): racecheck reports hazards on the
    lowering's capture bytes in exactly the variants whose default partition executes
    ``bar.sync 0, 128`` before the region (an mbarrier init's fence, a 229 KB allocation's
    init, an explicit CTA barrier, a TMA setup); the variants without it (the bare protocol,
    22 captured values) show none. Every access to those bytes sits between two CTA-wide
    ``barrier.sync 1`` (docs/NOTES.md has the PTX), and barrier 0 counted over 128 threads is
    legal PTX that no worker warp joins; racecheck's ordering is what the partial barrier
    throws off, not the kernel's. If a variant ever shows hazards without that barrier (or none
    with it), this fails and the explanation is wrong."""
    for v, r in ladder.items():
        if v == "tkit":
            continue
        assert (r["hazards"] > 0) == _partial_bar0(v), (v, r["hazards"])


def test_every_probe_variant_compiles_for_sm90a_and_adds_what_it_says():
    """No GPU needed: each variant of the ladder compiles ahead of time for sm_90a, and the
    large-allocation variants put the lowering's bytes above tkit's 229376 bytes of tiles."""
    shared = {}
    for v in P.LADDER:
        if v != "tkit":
            shared[v] = P.compile_sm90(v).metadata.shared
    assert shared["shaped"] < 64 and shared["shaped+tma"] > P.TILE_N * P.TILE_N * 2
    assert all(n > P.TKIT_TILES for v, n in shared.items() if "smem" in v)
    assert all(n <= 232448 for n in shared.values())  # sm_90's shared memory a block
    with pytest.raises(ValueError):
        P.parse("shaped+nope")
