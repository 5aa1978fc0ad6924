"""The benchmark harness: roofline arithmetic, reports, and the CLI on a machine without GPU."""

import json

import pytest
import torch

from tkit import cli, registry
from tkit.bench import report, runner
from tkit.bench.ceilings import Ceilings
from tkit.registry import Case, Cost

CEIL = Ceilings("test-gpu", copy_tbps=4.0, bf16_tflops=800.0, measured_at="now", torch="x")


def test_floor_is_the_larger_of_memory_and_math_time():
    # 4 GB at 4 TB/s is 1 ms; 400 GFLOP at 800 TFLOP/s is 0.5 ms
    assert CEIL.floor_ms(4e9, 4e11) == pytest.approx(1.0)
    assert CEIL.floor_ms(4e6, 8e12) == pytest.approx(10.0)


def _rows():
    spec = registry.get("add")
    case = Case("n", lambda d: ((), {}), "contiguous")
    cost = Cost(bytes=4e9, flops=1e9)
    env = {"device": "test-gpu", "date": "2026-01-01"}
    return [
        runner._row(spec, case, "tkit", cost, (1.25, 1.2, 1.3), CEIL, env),
        runner._row(spec, case, "torch", cost, (2.5, 2.4, 2.6), CEIL, env),
        runner._row(spec, case, "torch.compile", cost, None, CEIL, env, ok=False, note="x"),
    ]


def test_rows_carry_rates_and_percent_of_roofline():
    tk = _rows()[0]
    assert tk["tbps"] == pytest.approx(3.2)  # 4 GB in 1.25 ms
    assert tk["pct_of_roofline"] == pytest.approx(80.0)  # floor 1 ms over 1.25 ms


def test_summary_ratio_is_baseline_time_over_tkit_time(tmp_path):
    line = report.summary(_rows())[0]
    assert line["vs"]["torch"] == pytest.approx(2.0)
    assert line["vs"]["torch.compile"] is None
    jpath, mpath = report.write_results(_rows(), tmp_path, CEIL,
                                        {"device": "test-gpu", "date": "2026-01-01"})
    data = json.loads(jpath.read_text())
    assert len(data["rows"]) == 3 and data["ceilings"]["copy_tbps"] == 4.0
    md = mpath.read_text()
    assert "| add | n | 1.2500 | 3.20 |" in md and "x torch" in md


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU path of tkit bench")
def test_cli_bench_without_gpu_checks_ops_in_the_interpreter(capsys, tmp_path):
    rc = cli.main(["bench", "add", "silu_mul", "--out", str(tmp_path)])
    out = capsys.readouterr().out
    assert rc == 0
    assert "timings need a CUDA GPU" in out
    assert "silu_mul" in out and "passed, 0 failed" in out


def test_quick_plan_takes_each_ops_first_case_of_the_chosen_groups():
    specs = registry.select(["add", "silu"])
    full = runner.plan_cases(specs)
    quick = runner.plan_cases(specs, quick=True)
    assert [(s.name, c.label) for s, c in quick] == [
        (s.name, s.bench_cases()[0].label) for s in specs]
    assert len(full) > len(quick)
    strided = runner.plan_cases(specs, groups=["strided"], quick=True)
    assert strided and all(c.group == "strided" for _, c in strided)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU path of tkit bench")
def test_tkit_bench_command_in_a_fresh_process_without_gpu(tmp_path):
    """The README's main command as a user runs it: a new process, no TRITON_INTERPRET set."""
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    out = subprocess.run([sys.executable, "-m", "tkit.cli", "bench", "add", "silu",
                          "--out", str(tmp_path)], capture_output=True, text=True, env=env,
                         timeout=300)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    assert "timings need a CUDA GPU" in out.stdout and "passed, 0 failed" in out.stdout


def test_cli_rejects_unknown_op():
    with pytest.raises(KeyError, match="unknown op or family: nope"):
        cli.main(["bench", "nope"])


def test_cli_info_runs(capsys):
    assert cli.main(["info"]) == 0
    out = capsys.readouterr().out
    assert "silu_mul" in out and "torch" in out
    # which attention forward runs here, and why
    assert "flash_attention forward: " in out
    if not torch.cuda.is_available():
        assert "needs an sm_90 GPU; none here" in out


@pytest.mark.gpu
def test_bench_on_gpu_measures_and_verifies(tmp_path):
    spec = registry.get("add")
    spec_small = registry.OpSpec(**{**spec.__dict__, "bench_cases": lambda: [
        Case("1Mi", lambda d: ((torch.randn(1 << 20, device=d), torch.randn(1 << 20, device=d)),
                              {}), "contiguous")]})
    rows = runner.bench_specs([spec_small], CEIL, rounds=1, rep_ms=10, progress=False)
    tk = next(r for r in rows if r["provider"] == "tkit")
    assert tk["ok"] and tk["median_ms"] > 0 and tk["tbps"] > 0
    assert {r["provider"] for r in rows} >= {"tkit", "torch", "torch.compile"}
