"""benchmarks/reliability.py on a CPU: compute-sanitizer's summaries parsed from canned text,
the sanitizer's task list, and a tiny fuzz-only campaign under the interpreter (one with
enough time for its examples, one whose budget runs out)."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks" / "reliability.py"


@pytest.fixture(scope="module")
def rel():
    spec = importlib.util.spec_from_file_location("reliability", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


MEMCHECK_TWO = """\
========= COMPUTE-SANITIZER
========= Invalid __global__ write of size 4 bytes
=========     at 0x1a0 in /work/tkit/kernels/elementwise.py:150:_ew_flat_kernel
=========     by thread (31,0,0) in block (2,0,0)
=========     Address 0x7f1c2e000400 is out of bounds
=========     and is 1 bytes after the nearest allocation at 0x7f1c2e000000 of size 1023 bytes
=========
========= Invalid __global__ read of size 2 bytes
=========     at 0x90 in /work/tkit/kernels/norm.py:88:_rms_norm_fwd_kernel
=========
RESULT {"op": "add", "check_cases": 5}
========= ERROR SUMMARY: 2 errors
"""
MEMCHECK_CLEAN = "========= COMPUTE-SANITIZER\nRESULT {}\n========= ERROR SUMMARY: 0 errors\n"
RACECHECK = """\
========= COMPUTE-SANITIZER
========= Error: Race reported between Write access at 0x3c0 in /work/tkit/kernels/matmul.py:61
=========     and Read access at 0x410 in /work/tkit/kernels/matmul.py:70 [128 hazards]
=========
========= RACECHECK SUMMARY: 1 hazard displayed (1 error, 0 warnings)
"""


def test_memcheck_summary_and_first_reports(rel):
    out = rel.parse_sanitizer(MEMCHECK_TWO)
    assert out["errors"] == 2 and out["hazards"] is None
    assert out["first_reports"][0] == "Invalid __global__ write of size 4 bytes"
    assert any("out of bounds" in r for r in out["first_reports"])
    assert rel.parse_sanitizer(MEMCHECK_CLEAN)["errors"] == 0


def test_racecheck_summary(rel):
    out = rel.parse_sanitizer(RACECHECK)
    assert (out["hazards"], out["race_errors"], out["race_warnings"]) == (1, 1, 0)
    assert out["first_reports"][0].startswith("Error: Race reported between Write access")


def test_a_run_cut_short_has_no_counts(rel):
    cut = MEMCHECK_TWO.split("RESULT")[0]
    out = rel.parse_sanitizer(cut)
    assert out["errors"] is None and out["hazards"] is None
    assert rel.summarize([{"part": "sanitizer", "op": "add", "tool": "memcheck",
                           "case": "edge", **out}])["sanitizer_incomplete"] == [
        "add/memcheck/edge"]


def test_sanitizer_tasks_racecheck_only_where_shared_memory_is_used(rel):
    from tkit import registry

    specs = registry.select(["add", "rms_norm", "matmul", "cuda_sgemm_naive"])
    tasks = rel._sanitizer_tasks(specs, ["memcheck", "racecheck"])
    assert tasks[:2] == [("add", "memcheck", True), ("rms_norm", "memcheck", True)]
    assert {t[0] for t in tasks if t[1] == "memcheck" and not t[2]} == {s.name for s in specs}
    # "matmul" is a family too: its fp8, gated, grouped and int4 GEMMs come along
    assert {t[0] for t in tasks if t[1] == "racecheck"} == {
        "rms_norm", "matmul", "matmul_fp8", "matmul_glu", "grouped_matmul", "matmul_int4"}


def _campaign_parts(tmp_path, *extra):
    out = tmp_path / "rel.jsonl"
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(ROOT)}
    p = subprocess.run([sys.executable, str(SCRIPT), "--jobs", "1", "--out", str(out), *extra],
                       capture_output=True, text=True, env=env, timeout=600)
    assert p.returncode == 0, p.stdout + p.stderr
    return [json.loads(ln) for ln in out.read_text().splitlines()], p.stdout


def _campaign(tmp_path, *extra):
    return _campaign_parts(tmp_path, "--fuzz-only", *extra)


def test_a_tiny_fuzz_campaign_under_the_interpreter(tmp_path):
    rows, _ = _campaign(tmp_path, "--ops", "add", "--examples", "3", "--budget", "300")
    fz = [r for r in rows if r["part"] == "fuzz"]
    assert len(fz) == 1 and fz[0]["op"] == "add"
    assert fz[0]["status"] == "pass" and fz[0]["examples"] == 3
    assert not fz[0]["stopped_by_budget"]
    assert fz[0]["mismatches"] == 0 and fz[0]["git_sha"] and fz[0]["device"] == "cpu"
    # where the time went: the phases of the examples, the compiles (none in the interpreter)
    # and where the float64 reference ran
    for key in ("make_s", "fn_s", "reference_s", "compare_s", "compiles", "variants",
                "compile_s", "rejected_new_variant", "replayed", "budget_s",
                "compile_budget_s"):
        assert key in fz[0], key
    assert fz[0]["compiles"] == 0 and fz[0]["reference_device"] == "cpu"
    assert fz[0]["make_s"] + fz[0]["fn_s"] + fz[0]["reference_s"] + fz[0]["compare_s"] <= \
        fz[0]["seconds"]
    summary = rows[-1]
    assert summary["part"] == "summary" and summary["fuzz_examples"] == 3
    assert summary["fuzz_ops_short"] == [] and summary["fuzz_min_examples"] == 3
    assert summary["expected_op_budget_s"] == 300.0


def test_the_budget_stops_examples_cleanly_and_records_what_ran(tmp_path):
    # 100000 examples of two ops cannot run in 20 s in the interpreter (1000 could: CI under
    # triton 3.9 ran them, 2026-12-03): each op stops at its slice, passes, and says how many
    # it ran
    rows, _ = _campaign(tmp_path, "--ops", "add", "relu", "--examples", "100000",
                        "--budget", "20")
    fz = {r["op"]: r for r in rows if r["part"] == "fuzz"}
    assert set(fz) == {"add", "relu"}
    for r in fz.values():
        assert r["status"] == "pass", r
        assert 0 < r["examples"] < 100000 and r["stopped_by_budget"]
    assert sorted(rows[-1]["fuzz_ops_short"]) == ["add", "relu"]


def test_the_op_slices_share_the_lane_seconds_out(rel):
    # 42 ops on 16 lanes in 350 s: 133 s each at the start
    assert rel.op_slice(350.0, 16, 41, 0) == pytest.approx(350 * 16 / 42)
    # later, with 3 ops waiting and 15 running: an equal share of what is left
    assert rel.op_slice(100.0, 16, 3, 15) == pytest.approx(100 * 16 / 19)
    # the last op alone may take what is left, not past the deadline
    assert rel.op_slice(100.0, 16, 0, 0) == 98.0 and rel.op_slice(1.0, 16, 0, 0) == 0.0


def test_every_registered_op_has_a_recipe_the_campaign_runs_or_a_reason(rel):
    from tkit import registry

    specs = registry.all_specs()
    order = rel.fuzz_order(specs)
    assert set(order) | set(rel.FUZZ_EXCLUDED) == {s.name for s in specs}
    assert set(rel.FUZZ_EXCLUDED) == {"llama_layer"}
    for s in specs:
        recipe = s.fuzz()
        assert "shapes" in recipe, s.name
    # the heaviest compiles go first
    fam = {s.name: s.family for s in specs}
    assert fam[order[0]] == "attention" and fam[order[-1]] == "elementwise"


def test_an_excluded_op_gets_a_row_with_its_reason(tmp_path):
    rows, _ = _campaign(tmp_path, "--ops", "llama_layer", "--examples", "2", "--budget", "60")
    fz = [r for r in rows if r["part"] == "fuzz"]
    assert fz == [r for r in fz if r["op"] == "llama_layer"] and len(fz) == 1
    assert fz[0]["status"] == "excluded" and "model spec" in fz[0]["reason"]
    assert rows[-1]["fuzz_ops_excluded"] == ["llama_layer"]
    assert rows[-1]["fuzz_ops_short"] == [] and rows[-1]["fuzz_ops_not_run"] == []


STAND_IN = """#!/bin/sh
# compute-sanitizer's command line, its summary line, no instrumentation
shift 4  # --tool NAME --print-limit N
"$@"
echo "========= ERROR SUMMARY: 0 errors"
"""


def test_the_sanitizer_part_end_to_end_with_a_stand_in(tmp_path):
    # no GPU here: a stand-in for compute-sanitizer runs the child as the real one would and
    # prints a clean summary; the row must carry that count and the child's own result
    stand_in = tmp_path / "compute-sanitizer"
    stand_in.write_text(STAND_IN)
    stand_in.chmod(0o755)
    rows, _ = _campaign_parts(tmp_path, "--sanitizer-only", "--sanitizer", str(stand_in),
                              "--ops", "add", "--sanitizer-examples", "2", "--budget", "300",
                              "--tools", "memcheck")
    sn = [r for r in rows if r["part"] == "sanitizer"]
    assert len(sn) == 1 and sn[0]["op"] == "add" and sn[0]["tool"] == "memcheck"
    assert sn[0]["errors"] == 0 and sn[0]["status"] == "exit 0", sn[0]
    from tkit import registry

    result = sn[0]["result"]
    assert result["check_cases"] == len(registry.get("add").check_cases())
    assert result["check_failures"] == [] and result["fuzz"]["examples"] == 2
    assert rows[-1]["sanitizer_runs"] == 1 and rows[-1]["sanitizer_incomplete"] == []


def test_count_variants_bounds_the_compiles_and_keeps_the_examples_coming(tmp_path):
    # no GPU and no interpreter: add's launches recorded on meta tensors at GPU sizes; 150
    # examples would compile dozens of variants, the bounded run reaches its 150 examples on 12
    out = tmp_path / "variants.jsonl"
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = str(ROOT)
    rows = {}
    for bound in (None, 12):
        argv = [sys.executable, str(SCRIPT), "--count-variants", "--ops", "add",
                "--examples", "150", "--out", str(out)]
        if bound:
            argv += ["--max-variants", str(bound)]
        p = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=600)
        assert p.returncode == 0, p.stdout + p.stderr
        rows[bound] = json.loads(out.read_text().splitlines()[-1])
    free, bounded = rows[None], rows[12]
    assert free["examples"] == 150 and free["variants"] > 30
    assert bounded["examples"] == 150 and bounded["variants"] == 12
    assert bounded["replayed"] > 0 and bounded["rejected_new_variant"] > 0
    assert bounded["replay_invalid"] == 0


def test_ws_lowering_hazards_are_counted_apart(rel):
    """racecheck reports located only at a warp-specialized Gluon kernel's first line and its
    warp_specialize call are the known misreport; one report anywhere else makes them all
    count. racecheck names files without their directory (as in the H200's reports of
    2026-12-03: "... Read access at _fp8_block_ws_kernel+0x120 in
    _fp8_block_hopper_kernels.py:459"), so the kernels' file names must differ."""
    known = rel.ws_lowering_lines()
    files = {f for f, _ in known}
    assert len(known) == 6 and files == {"_hopper_kernels.py", "_gemm_hopper_kernels.py",
                                         "_fp8_block_hopper_kernels.py"}
    (f, a), (_, b) = sorted(k for k in known if k[0] == "_fp8_block_hopper_kernels.py")
    text = (f"========= Error: Race reported between Read access at _k+0x120 in {f}:{a}\n"
            f"=========     and Write access at 0x2c0 in /x/{f}:{b}:_k\n")
    assert rel.explained_hazards(text, 87, known) == 87
    assert rel.explained_hazards(text + f"at 0x10 in /x/{f}:{b + 1}:_k\n", 87, known) == 0
    assert rel.explained_hazards("", 3, known) == 0
