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


def test_cli_rejects_unknown_op_and_group_with_suggestions(capsys):
    assert cli.main(["bench", "rms_nrom"]) == 2
    err = capsys.readouterr().err
    assert "unknown op or family" in err and "'rms_nrom'; did you mean rms_norm" in err
    assert cli.main(["bench", "add", "--group", "strieded"]) == 2
    err = capsys.readouterr().err
    assert "--group 'strieded'" in err and "did you mean strided?" in err
    assert cli.main(["bench", "add", "--case-timeout", "0"]) == 2
    assert "--case-timeout must be positive" in capsys.readouterr().err
    assert cli.main(["bench", "add", "--rounds", "0"]) == 2
    assert "--rounds must be at least 1" in capsys.readouterr().err
    assert cli.main(["bench", "add", "--warm-jobs", "-1"]) == 2
    assert "--warm-jobs must be 0 or more" in capsys.readouterr().err


def test_cli_info_runs(capsys):
    assert cli.main(["info"]) == 0
    out = capsys.readouterr().out
    assert "silu_mul" in out and "torch" in out
    # which attention forward runs here, and why
    assert "flash_attention forward: " in out and "matmul (16-bit): " in out
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


# ---- a run that survives its failures -------------------------------------------------------
def _ok_and_failed(rows):
    mine = {r["case"]: r for r in rows if r["provider"] == "tkit"}
    return ({c for c, r in mine.items() if r["median_ms"]},
            {c: r["note"] for c, r in mine.items() if not r["median_ms"]})


def _write_and_report(rows, tmp_path, capsys):
    import argparse

    args = argparse.Namespace(stem="fake", plot=True)
    rc = cli._report(args, rows, CEIL, tmp_path)
    out = capsys.readouterr().out
    data = json.loads((tmp_path / "fake.json").read_text())
    return rc, out, data


def test_a_case_that_raises_is_reported_and_the_rest_run_in_process(monkeypatch, tmp_path,
                                                                     capsys):
    import fake_specs

    monkeypatch.setattr(runner, "time_fn", fake_specs.fake_time_fn)
    rows = runner.bench_specs(fake_specs.SPECS[:1], CEIL, rounds=1, device="cpu",
                              progress=False)
    ok, failed = _ok_and_failed(rows)
    assert ok == {"64x32 ok"}
    assert "ValueError: boom" in failed["64x32 raise"]
    assert "illegal memory access" in failed["64x32 lost"]
    out = capsys.readouterr().out
    # one line a finished case, failures with their error
    assert "[2/3" in out and "fake_a 64x32 raise: FAILED ValueError: boom" in out
    assert "fake_a 64x32 ok: tkit" in out and "best baseline torch" in out
    rc, out, data = _write_and_report(rows, tmp_path, capsys)
    assert rc == 1 and "1 timed and verified, 0 timed but wrong, 2 failed" in out
    assert len(data["rows"]) == 1 + 2 + 1  # ok: tkit + torch; the failures: tkit each
    assert all(r["case_seconds"] is not None for r in data["rows"])
    assert (tmp_path / "fake.md").exists()


def _child_command(tmp_path, specs="SPECS", fake_timer=True):
    """A child that looks cases up in tests/bench/fake_specs.py."""
    import sys
    import textwrap
    from pathlib import Path

    here = Path(__file__).resolve().parent
    script = tmp_path / "child.py"
    script.write_text(textwrap.dedent(f"""
        import sys
        sys.path[:0] = [{str(here)!r}, {str(here.parents[1])!r}]
        import fake_specs
        from tkit.bench import child, runner
        if {fake_timer!r}:
            runner.time_fn = fake_specs.fake_time_fn
        child.main(sys.argv[1:], specs=fake_specs.{specs})
    """))
    return [sys.executable, str(script)]


def test_isolated_run_survives_an_error_a_lost_context_and_a_dead_child(tmp_path, capsys):
    """Each case in a child: the lost context and the dead child cost their case only; a new
    child runs the rest; the results file and the plot are written."""
    import fake_specs

    rows = runner.bench_specs(fake_specs.SPECS, CEIL, rounds=1, device="cpu", isolate=True,
                              child_command=_child_command(tmp_path), progress=False,
                              case_timeout=120)
    ok, failed = _ok_and_failed(rows)
    assert ok == {"64x32 ok"}  # fake_a's and fake_b's ok cases share a label
    assert sum(1 for r in rows if r["provider"] == "tkit" and r["median_ms"]) == 2
    assert "ValueError: boom" in failed["64x32 raise"]
    assert "illegal memory access" in failed["64x32 lost"]
    assert failed["64x32 die"].startswith("child died") and "about to die" in failed["64x32 die"]
    out = capsys.readouterr().out
    assert "[5/5" in out and "fake_b 64x32 die: FAILED child died" in out
    rc, out, data = _write_and_report(rows, tmp_path, capsys)
    assert rc == 1 and "2 timed and verified, 0 timed but wrong, 3 failed" in out
    assert [(r["op"], r["case"]) for r in data["rows"] if r["provider"] == "tkit"] == [
        ("fake_a", "64x32 ok"), ("fake_a", "64x32 raise"), ("fake_a", "64x32 lost"),
        ("fake_b", "64x32 die"), ("fake_b", "64x32 ok")]
    pytest.importorskip("matplotlib")
    assert (tmp_path / "fake.png").exists()


def test_warm_up_makes_every_cases_first_calls_in_parallel_before_any_timing(
        tmp_path, capsys, monkeypatch):
    """--warm-jobs: every case's first calls run in that many processes before the first case
    is timed; a case that fails or kills its process in the warm-up is still timed and
    reported; rows carry the warm-up's seconds for the next run's estimate."""
    import fake_specs

    log = tmp_path / "calls.log"
    monkeypatch.setenv("FAKE_BENCH_LOG", str(log))
    monkeypatch.delenv("TORCHINDUCTOR_COMPILE_THREADS", raising=False)
    rows = runner.bench_specs(fake_specs.SPECS, CEIL, rounds=1, device="cpu", isolate=True,
                              child_command=_child_command(tmp_path), progress=False,
                              case_timeout=120, warm_jobs=2)
    calls = [line.split() for line in log.read_text().splitlines()]
    first = next(i for i, c in enumerate(calls) if c[3] == "timing")
    warm, timed = calls[:first], calls[first:]
    assert all(c[3] == "timing" for c in timed)  # nothing warms up once the timing begins
    assert sorted(c[1] for c in warm) == ["die", "lost", "ok", "ok", "raise"]
    assert len({c[0] for c in warm}) >= 2  # two processes at once (and one more after "die")
    assert not {c[0] for c in warm} & {c[0] for c in timed}
    assert all(c[2] == "1" for c in calls)  # inductor compiles in the child, no worker pool
    out = capsys.readouterr().out
    assert "warming up 5 cases in 2 processes" in out and "warmed up in" in out
    # the lost context and the dead child; a case that raises is left to the timing pass
    assert "2 cases failed to warm up (timed anyway): fake_a/2, fake_b/0" in out
    ok, failed = _ok_and_failed(rows)
    assert ok == {"64x32 ok"} and set(failed) == {"64x32 raise", "64x32 lost", "64x32 die"}
    oks = [r for r in rows if r["provider"] == "tkit" and r["median_ms"]]
    assert len(oks) == 2 and all(r["warm_seconds"] is not None for r in oks)


@pytest.mark.skipif(torch.cuda.is_available(), reason="drives the GPU path of the CLI on a CPU")
def test_cli_bench_gpu_path_reports_failures_and_writes_everything(monkeypatch, tmp_path,
                                                                   capsys):
    """tkit bench as on a GPU (ceilings, timer and specs faked): the estimate, a line per case,
    the failures named at the end, the results and the plot written, exit status 1."""
    import fake_specs

    from tkit.bench import ceilings

    monkeypatch.setattr(cli, "_prepare_backend", lambda: True)
    monkeypatch.setattr(registry, "_SPECS", {s.name: s for s in fake_specs.SPECS[:1]})
    monkeypatch.setattr(ceilings, "get", lambda remeasure=False: CEIL)
    monkeypatch.setattr(runner, "time_fn", fake_specs.fake_time_fn)
    env = runner.environment()
    monkeypatch.setattr(runner, "environment", lambda: {**env, "device": CEIL.device})
    argv = ["bench", "fake_a", "--in-process", "--plot", "--out", str(tmp_path), "--stem", "x"]
    assert cli.main(argv) == 1
    out = capsys.readouterr().out
    assert "3 cases, estimated wall time ~" in out and "(an estimate:" in out
    assert "[3/3" in out and "fake_a 64x32 raise: ValueError: boom" in out
    data = json.loads((tmp_path / "x.json").read_text())
    assert len([r for r in data["rows"] if r["provider"] == "tkit"]) == 3
    pytest.importorskip("matplotlib")
    assert (tmp_path / "x.png").exists()
    # the next run's estimate comes from this one's case times
    assert cli.main(argv) == 1
    assert "3 timed by earlier runs" in capsys.readouterr().out


def test_cli_bench_names_baselines_that_are_not_available(monkeypatch, tmp_path, capsys):
    """A declared baseline whose factory returns None here (a library not installed, a failed
    probe) has no rows, and the run says so by name instead of dropping it silently."""
    import dataclasses

    import fake_specs

    from tkit.bench import ceilings

    spec = dataclasses.replace(fake_specs.SPECS[0], bench_cases=lambda: [fake_specs._case("ok")],
                               baselines={**fake_specs.SPECS[0].baselines,
                                          "absent lib": lambda: None})
    monkeypatch.setattr(cli, "_prepare_backend", lambda: True)
    monkeypatch.setattr(registry, "_SPECS", {spec.name: spec})
    monkeypatch.setattr(ceilings, "get", lambda remeasure=False: CEIL)
    monkeypatch.setattr(runner, "time_fn", fake_specs.fake_time_fn)
    env = runner.environment()
    monkeypatch.setattr(runner, "environment", lambda: {**env, "device": CEIL.device})
    assert cli.main(["bench", "fake_a", "--in-process", "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "fake_a: no rows for absent lib: not available here" in out
    rows = json.loads(next(tmp_path.glob("*.json")).read_text())["rows"]
    assert {r["provider"] for r in rows} == {"tkit", "torch"}
    assert cli.main(["bench", "fake_a", "--in-process", "--no-baselines", "--out",
                     str(tmp_path)]) == 0
    assert "not available here" not in capsys.readouterr().out


@pytest.mark.skipif(torch.cuda.is_available(), reason="drives the GPU path of the CLI on a CPU")
def test_cli_bench_appends_long_form_rows_to_the_devices_file(monkeypatch, tmp_path, capsys):
    """tkit bench (GPU path faked) appends its rows to <out>/<device>.jsonl with the run id, the
    environment and the times; a rerun under the same stem replaces its rows, another appends."""
    import fake_specs

    from tkit.bench import ceilings

    monkeypatch.setattr(cli, "_prepare_backend", lambda: True)
    monkeypatch.setattr(registry, "_SPECS", {s.name: s for s in fake_specs.SPECS[:1]})
    monkeypatch.setattr(ceilings, "get", lambda remeasure=False: CEIL)
    monkeypatch.setattr(runner, "time_fn", fake_specs.fake_time_fn)
    env = {**runner.environment(), "device": "NVIDIA Test GPU", "git_sha": "abc1234"}
    monkeypatch.setattr(runner, "environment", lambda: env)
    argv = ["bench", "fake_a", "--in-process", "--out", str(tmp_path)]
    cli.main(argv + ["--stem", "run1"])
    path = tmp_path / "test-gpu.jsonl"
    assert path.name in capsys.readouterr().out
    rows = report.read_long_form(path)
    per_run = json.loads((tmp_path / "run1.json").read_text())["rows"]
    assert len(rows) == len(per_run) > 0  # the per-run file is still written
    assert list(rows[0])[:9] == list(report.LONG_FIELDS)
    for r in rows:
        assert r["run"] == "run1" and r["device"] == "NVIDIA Test GPU"
        assert r["git_sha"] == "abc1234" and r["torch"] == torch.__version__
        assert r["date"] == env["date"] and r["source"] == "tkit bench"
    timed = [r for r in rows if r["median_ms"]]
    assert timed and all(r["p20_ms"] <= r["median_ms"] <= r["p80_ms"] for r in timed)
    assert {(r["op"], r["provider"]) for r in timed} >= {("fake_a", "tkit")}
    cli.main(argv + ["--stem", "run1"])  # the same run again: replaced, not doubled
    assert len(report.read_long_form(path)) == len(rows)
    cli.main(argv + ["--stem", "run2"])
    runs = [r["run"] for r in report.read_long_form(path)]
    assert runs == ["run1"] * len(rows) + ["run2"] * len(rows)
    readme = (tmp_path / "README.md").read_text()  # regenerated from the long-form file
    assert "| fake_a | 64x32 ok |" in readme and "run2" in readme and "run1 |" not in readme


def test_readme_table_shows_the_latest_row_of_each_op_case_and_provider(tmp_path):
    def row(run, date, provider, ms, **kw):
        return {"run": run, "date": date, "device": "NVIDIA H200", "op": "add",
                "case": "16384x8192", "provider": provider, "median_ms": ms, "p20_ms": ms * 0.99,
                "p80_ms": ms * 1.01, "tbps": 0.8 / ms, "bound": "memory", "ok": True,
                "group": "elementwise", "git_sha": "f00d", **kw}

    lines = [row("h200-a", "2026-11-29", "tkit", 0.25), row("h200-a", "2026-11-29", "torch", 0.2),
             row("h200-b", "2026-11-30", "tkit", 0.19),
             row("h200-s", "2026-11-30", "tkit 128x64", 0.3, source="script (sweep)"),
             row("h200-k", "2026-12-01", "tkit", 0.15, timer="kernels")]
    (tmp_path / "h200.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))
    (tmp_path / "h200-2026-12-01-x-reliability.jsonl").write_text('{"run": "x", "op": "add"}\n')
    text = report.write_readme(tmp_path).read_text()
    table = [ln for ln in text.splitlines() if ln.startswith("| add")]
    # tkit's newest event-timed row and torch's; the script's and the kernel timer's rows are
    # counted below
    assert len(table) == 2
    assert table[0].startswith("| add | 16384x8192 | elementwise | tkit | 0.19 |")
    assert "| h200-b | f00d |" in table[0] and "4.21 TB/s" in table[0]
    assert "| torch | 0.2 |" in table[1] and "| h200-a |" in table[1]
    assert "## NVIDIA H200 (`h200.jsonl`)" in text and "reliability" not in text
    assert "2 rows from 2 runs of probe scripts, other benchmarks and kernel timers" in text
    assert "`h200-s` (1)" in text and "`h200-k` (1)" in text


def test_readme_report_counts_the_devices_checks_file_by_run_and_status(tmp_path):
    """<device>-checks.jsonl (records that time nothing) is not a device section of its own:
    its runs are listed under the device's timings, counted by part / status / ok."""
    timed = {"run": "h200-a", "date": "2026-12-01", "device": "NVIDIA H200", "op": "add",
             "case": "c", "provider": "tkit", "median_ms": 0.2, "git_sha": "f00d"}
    checks = [{"run": "h200-b-reliability", "op": "add", "case": None, "provider": "fuzz",
               "part": "fuzz", "status": s, "source": "benchmarks/reliability.py"}
              for s in ("pass", "pass", "fail")]
    checks.append({"run": "h200-c-cuda_ext", "op": "sgemm", "case": "M1", "provider": None,
                   "ok": True, "source": "script (cuda_ext) check"})
    ceil = {**timed, "op": "ceilings", "median_ms": None, "copy_tbps": 4.2, "bf16_tflops": 680,
            "source": "tkit bench ceilings"}
    (tmp_path / "h200.jsonl").write_text(json.dumps(timed) + "\n" + json.dumps(ceil) + "\n")
    path = report.checks_path(tmp_path, "NVIDIA H200")
    assert path.name == "h200-checks.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in checks))
    text = report.write_readme(tmp_path).read_text()
    assert text.count("## ") == 1 and "## NVIDIA H200 (`h200.jsonl`)" in text
    assert "Checks (`h200-checks.jsonl`" in text
    assert ("- `h200-b-reliability` (benchmarks/reliability.py): 3 records: fuzz pass 2, "
            "fuzz fail 1") in text
    assert "- `h200-c-cuda_ext` (script (cuda_ext) check): 1 records: ok 1" in text
    assert "latest copy 4.2 TB/s (bytes read + written), bf16 matmul 680 TFLOP/s, run `h200-a`" \
        in text and "rows from" not in text  # the ceilings row is no probe script's


def test_convert_reads_tkit_bench_and_script_result_files(tmp_path):
    bench = {"environment": {"device": "NVIDIA H200", "date": "2026-12-01", "git_sha": "aa"},
             "rows": [{"op": "add", "case": "c", "provider": "tkit", "median_ms": 1.0,
                       "p20_ms": 0.9, "p80_ms": 1.1, "device": "NVIDIA H200"}]}
    script = {"meta": {"device": "NVIDIA H200", "git_sha": "bb", "torch": "2.11"},
              "rows": [{"section": "square", "shape": "4096^3", "provider": "cuBLAS", "ms": 0.2,
                        "p20": 0.19, "p80": 0.21, "tflops": 700.0},
                       {"kind": "config", "provider": "mma:base"},  # nothing timed: skipped
                       {"op": "rms_norm", "N": 1024, "check_ok": True,
                        "providers": {"tkit": {"median_ms": 0.13, "tbs": 4.1}}}]}
    (tmp_path / "h200-2026-12-01-a-quick.json").write_text(json.dumps(bench))
    (tmp_path / "h200-2026-11-29-b-matmul.json").write_text(json.dumps(script))
    out = tmp_path / "out"
    counts = report.convert(sorted(tmp_path.glob("*.json")), out)
    assert counts == {out / "h200.jsonl": 3}
    rows = report.read_long_form(out / "h200.jsonl")
    assert [(r["run"], r["op"], r["case"], r["provider"], r["median_ms"]) for r in rows] == [
        ("h200-2026-11-29-b-matmul", "matmul", "square 4096^3", "cuBLAS", 0.2),
        ("h200-2026-11-29-b-matmul", "rms_norm", "N=1024 events", "tkit", 0.13),
        ("h200-2026-12-01-a-quick", "add", "c", "tkit", 1.0)]
    assert rows[0]["p80_ms"] == 0.21 and rows[0]["git_sha"] == "bb"
    assert rows[0]["date"] == "2026-11-29" and rows[0]["source"] == "script (matmul)"
    assert rows[2]["git_sha"] == "aa" and rows[2]["source"] == "tkit bench"


def test_estimate_reads_the_previous_runs_case_times(tmp_path):
    import os

    from tkit.bench import estimate

    def write(name, rows, device="H", mtime=0):
        path = tmp_path / name
        path.write_text(json.dumps({"environment": {"device": device}, "rows": rows}))
        os.utime(path, (mtime, mtime))

    write("old.json", [{"op": "add", "case": "a", "case_seconds": 12.0},
                       {"op": "mul", "case": "c", "case_seconds": 5.0}], mtime=1000)
    write("new.json", [{"op": "add", "case": "a", "case_seconds": 10.0}], mtime=2000)
    write("elsewhere.json", [{"op": "add", "case": "b", "case_seconds": 99.0}], device="other")
    est = estimate.estimate([("add", "elementwise", "a"), ("add", "elementwise", "b"),
                             ("mul", "elementwise", "c")], tmp_path, "H")
    assert est["timed"] == 2 and est["per_case"] == [
        10.0, estimate.FAMILY_SECONDS["elementwise"], 5.0]  # the newest file's time wins
    text = estimate.describe(est, 3)
    assert "an estimate" in text and "2 timed by earlier runs (2 files in" in text
    assert estimate.estimate([("add", "elementwise", "a")], tmp_path, "another")["timed"] == 0
    # with a warm-up in 4 processes, a case's first-call time is shared four ways
    write("warm.json", [{"op": "sub", "case": "w", "case_seconds": 2.0, "warm_seconds": 8.0}],
          mtime=3000)
    est = estimate.estimate([("sub", "elementwise", "w"), ("add", "elementwise", "a")],
                            tmp_path, "H", warm_jobs=4)
    timing = 1.0 + 3 * 3 * 125 * 2.0 / 1e3  # 3 rounds x 3 providers, 100 ms windows
    assert est["per_case"] == pytest.approx([2.0 + 8.0 / 4, timing + (10.0 - timing) / 4])
    # the long-form rows fill in what no run file has (a fresh clone's committed results): the
    # last row of a case wins, other devices' rows are not read
    (tmp_path / "H.jsonl").write_text("\n".join(json.dumps(r) for r in [
        {"device": "H", "op": "neg", "case": "n", "case_seconds": 4.0, "warm_seconds": 1.0},
        {"device": "H", "op": "neg", "case": "n", "case_seconds": 3.0, "warm_seconds": 2.0},
        {"device": "other", "op": "neg", "case": "m", "case_seconds": 50.0},
        {"device": "H", "op": "add", "case": "a", "case_seconds": 70.0}]) + "\n")
    est = estimate.estimate([("neg", "elementwise", "n"), ("neg", "elementwise", "m"),
                             ("add", "elementwise", "a")], tmp_path, "H")
    assert est["timed"] == 2 and est["per_case"] == [
        3.0 + 2.0, estimate.FAMILY_SECONDS["elementwise"], 10.0]  # a run file beats the rows


# ---- what tkit bench says without a GPU ----------------------------------------------------
@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU path of tkit bench")
def test_cli_without_gpu_names_what_it_checked_and_skipped(capsys):
    rc = cli.main(["bench", "add", "matmul_fp8", "cuda_matmul", "--quick", "--plot"])
    out = capsys.readouterr().out
    assert rc == 0
    assert "checking 1 ops (1 cases): add" in out
    assert "matmul_fp8: Triton's interpreter converts float8 wrongly" in out
    assert "cuda_matmul: raw CUDA, no interpreter" in out
    assert "--plot: ignored" in out and "--quick: each op's first check case" in out
    rc = cli.main(["bench", "matmul_fp8"])
    out = capsys.readouterr().out
    assert rc == 1 and "nothing was checked" in out


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU path of tkit bench")
def test_cli_group_applies_to_the_check_cases(capsys):
    assert cli.main(["bench", "add", "--group", "broadcast"]) == 0
    out = capsys.readouterr().out
    assert "checking 1 ops (2 cases)" in out and "+ row" in out and "transposed" not in out


def test_softmax_check_raises_no_numpy_warning_in_the_interpreter():
    """Rows past M in a softmax program's last block held -inf - -inf (NaN, never stored), and
    the interpreter's numpy printed "invalid value encountered in subtract" above tkit bench's
    table."""
    import warnings

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        rows = runner.check_specs(registry.select(["softmax", "log_softmax"]), progress=False,
                                  quick=True)
    assert all(r["ok"] for r in rows)
    assert not [w for w in caught if issubclass(w.category, RuntimeWarning)], \
        [str(w.message) for w in caught]


def test_reporter_draws_a_bar_and_keeps_the_lines(capsys):
    pytest.importorskip("tqdm")
    import io

    from tkit.bench.progress import Reporter

    out = io.StringIO()
    rep = Reporter(2, "bench", bar=True, out=out)
    rows = _rows()
    for r in rows:
        r["case_seconds"] = 3.0
    rep.begin("add n")
    rep.done(rows)
    rep.close()
    assert "add n: tkit 3.20 TB/s (80% of roofline); best baseline torch 1.60 TB/s, x2.00" \
        in out.getvalue()
    assert "1/2" in capsys.readouterr().err  # the bar, on stderr


# ---- the CLI needs only the runtime dependencies --------------------------------------------
@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU path of tkit bench")
@pytest.mark.parametrize("commands", [
    # one process for the commands that switch the interpreter on, one for tkit ir (which
    # compiles ahead of time without it): a torch import each
    [(["info"], "flash_attention forward:"), (["bench", "--help"], "--case-timeout"),
     (["bench", "add", "--quick"], "1 passed, 0 failed")],
    [(["ir", "add", "--summary"], "add")],
], ids=["info-bench", "ir"])
def test_cli_runs_without_hypothesis(commands):
    """A `pip install -e .` without the test extra: importing hypothesis fails."""
    import os
    import subprocess
    import sys

    script = (
        "import sys\n"
        "sys.modules['hypothesis'] = None\n"
        "from tkit.cli import main\n"
        f"for argv in {[argv for argv, _ in commands]!r}:\n"
        "    try:\n"
        "        rc = main(argv)\n"
        "    except SystemExit as e:\n"
        "        rc = e.code\n"
        "    print(f'== {argv} exit {rc}', flush=True)\n")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                         env=env, timeout=600)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    assert "hypothesis" not in out.stderr, out.stderr[-2000:]
    rest = out.stdout
    for argv, expect in commands:
        head, sep, rest = rest.partition(f"== {argv} exit ")
        assert sep, f"{argv} did not finish: {out.stdout[-2000:]}{out.stderr[-2000:]}"
        assert rest.startswith("0"), f"{argv}: exit {rest[:3]}\n{head[-2000:]}"
        assert expect in head, head[-2000:]


# ---- on the GPU ---------------------------------------------------------------------------
@pytest.mark.gpu
def test_isolated_run_on_gpu_survives_an_illegal_address(tmp_path, capsys):
    """A kernel that stores out of bounds loses its child's CUDA context: that case fails with
    the CUDA error, a new child times the next one."""
    import fake_specs

    rows = runner.bench_specs(fake_specs.GPU_SPECS, CEIL, rounds=1, rep_ms=10, isolate=True,
                              child_command=_child_command(tmp_path, "GPU_SPECS", False),
                              progress=False, case_timeout=300)
    mine = [r for r in rows if r["provider"] == "tkit"]
    assert [bool(r["median_ms"]) for r in mine] == [True, False, True]
    assert "illegal" in mine[1]["note"] or "CUDA" in mine[1]["note"], mine[1]["note"]


@pytest.mark.gpu
def test_isolated_run_of_a_registered_op_on_gpu():
    rows = runner.bench_specs(registry.select(["add"]), CEIL, rounds=1, rep_ms=10, quick=True,
                              isolate=True, progress=False, warm_jobs=1)
    tk = next(r for r in rows if r["provider"] == "tkit")
    assert tk["ok"] and tk["median_ms"] > 0 and tk["case_seconds"] > 0 and tk["warm_seconds"]
    assert {r["provider"] for r in rows} >= {"tkit", "torch", "torch.compile"}


@pytest.mark.gpu
def test_tkit_bench_command_on_gpu_writes_results_and_plot(tmp_path):
    import os
    import subprocess
    import sys

    pytest.importorskip("matplotlib")
    out = subprocess.run([sys.executable, "-m", "tkit.cli", "bench", "add", "rms_norm",
                          "--quick", "--plot", "--rounds", "1", "--out", str(tmp_path),
                          "--stem", "t"], capture_output=True, text=True, timeout=600,
                         env=dict(os.environ))
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert "estimated wall time" in out.stdout and "[2/2" in out.stdout
    assert (tmp_path / "t.json").exists() and (tmp_path / "t.png").exists()


def test_rounds_rotate_the_providers(monkeypatch):
    """Each round times the providers in a rotated order, so that none keeps one position in
    every round (positions are not neutral on the GPU): over 3 rounds of 3 providers each
    takes every position once; over 2 rounds of 4, the second starts half way."""
    import fake_specs

    from tkit.bench.timing import round_order

    assert [round_order(list("abc"), r, 3) for r in range(3)] == [
        list("abc"), list("bca"), list("cab")]
    assert round_order(list("abcd"), 1, 2) == list("cdab")
    assert round_order([], 1, 2) == [] and round_order(list("ab"), 5) == list("ba")

    called = []

    def provider(name):
        def fn(a, b, mode="ok"):
            called.append(name)
            return a + b
        return fn

    spec = registry.OpSpec(**{**fake_specs.SPECS[0].__dict__, "fn": provider("tkit"),
                              "bench_cases": lambda: [fake_specs._case("ok")]})
    cache = {spec.name: {"b1": provider("b1"), "b2": provider("b2")}}
    monkeypatch.setattr(runner, "time_fn", fake_specs.fake_time_fn)  # one call a timing
    runner.bench_case(spec, spec.bench_cases()[0], CEIL, {}, cache, rounds=3, verify=False,
                      device="cpu")
    assert called == ["tkit", "b1", "b2", "b1", "b2", "tkit", "b2", "tkit", "b1"]
