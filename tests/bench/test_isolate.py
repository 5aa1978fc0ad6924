"""tkit.bench.isolate: the child-process check protocol, with a child that passes, fails, loses
its context, hangs and dies (no GPU: the child is a plain Python script)."""

from __future__ import annotations

import os
import sys
import textwrap
from pathlib import Path

import pytest

from tkit.bench.isolate import supervise

ROOT = Path(__file__).resolve().parents[2]

CHILD = textwrap.dedent("""
    import importlib.util, os, sys, time
    # the module alone (stdlib only), not the tkit package: the child starts in milliseconds
    spec = importlib.util.spec_from_file_location("isolate", {path!r})
    isolate = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(isolate)
    child_loop = isolate.child_loop

    def check_one(name):
        kind = name.split("-")[0]
        if kind == "good":
            return {{"err": len(name)}}
        if kind == "plain":
            return None
        if kind == "bad":
            raise ValueError("wrong\\nanswer")
        if kind == "ctx":
            raise RuntimeError("CUDA_ERROR_ILLEGAL_ADDRESS: an illegal memory access")
        if kind == "hang":
            time.sleep(60)
        if kind == "die":
            print("last words", flush=True)
            os._exit(3)
        if kind == "orphan":  # leaves a process behind that holds stdout open
            import subprocess
            p = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(90)"])
            print(f"orphaned {{p.pid}}", flush=True)
            os._exit(4)

    child_loop(sys.argv[1].split(","), check_one)
""")


@pytest.fixture
def child(tmp_path):
    path = tmp_path / "child.py"
    path.write_text(CHILD.format(path=str(ROOT / "tkit" / "bench" / "isolate.py")))
    started = []

    def argv_for(todo):
        started.append(list(todo))
        return [sys.executable, str(path), ",".join(todo)]

    return argv_for, started


def test_every_outcome_is_reported_and_a_child_is_replaced(child):
    argv_for, started = child
    names = ["good-a", "bad-b", "ctx-c", "plain-d", "hang-e", "die-f", "good-g"]
    logged = []
    status = supervise(argv_for, names, deadline=3.0, first_deadline=20.0, total=60.0,
                       hang_hint=" (hang?)", log=logged.append)
    assert status["good-a"] == ("ok", {"err": 6})
    assert status["good-g"] == ("ok", {"err": 6})
    assert status["plain-d"] == ("ok", None)
    assert status["bad-b"] == ("ValueError: wrong answer", None)
    assert status["ctx-c"][0].startswith("RuntimeError: CUDA_ERROR")
    assert status["hang-e"] == ("no answer within 3 s (hang?)", None)
    assert status["die-f"][0] == "child died (exit code 3): last words"
    # a new child after the lost context, the hang and the death, each on what was left
    assert started == [names, names[3:], names[5:], names[6:]]
    assert any("FAILED" in m for m in logged) and any(" ok (" in m for m in logged)


def test_a_child_that_dies_before_its_first_build_is_not_restarted(tmp_path):
    starts = []

    def argv_for(todo):
        starts.append(todo)
        return [sys.executable, "-c", "print('no GPU here'); raise SystemExit(1)"]

    status = supervise(argv_for, ["a", "b"], deadline=5.0, total=30.0, log=lambda m: None)
    assert len(starts) == 1
    why = "child died (exit code 1): no GPU here"
    assert status == {"a": (why, None), "b": (why, None)}


def test_names_left_when_the_budget_ends(child):
    argv_for, _ = child
    status = supervise(argv_for, ["hang-a", "good-b"], deadline=30.0, total=2.0,
                       log=lambda m: None)
    assert status["hang-a"][0].startswith("no answer")
    assert status["good-b"] == ("not checked: time budget", None)


def test_a_child_that_dies_leaving_its_output_open_is_seen_at_once(child):
    """A compile worker that outlives its child keeps the pipe open: no end of file comes, and
    the death must not wait for the case's deadline."""
    import time

    argv_for, started = child
    t0 = time.time()
    status = supervise(argv_for, ["orphan-a", "good-b"], deadline=60.0, first_deadline=60.0,
                       total=120.0, log=lambda m: None)
    elapsed = time.time() - t0
    why = status["orphan-a"][0]
    if why.startswith("child died (exit code 4): orphaned "):
        os.kill(int(why.split()[-1]), 9)  # the process it left behind
    assert why.startswith("child died (exit code 4): orphaned")
    assert status["good-b"] == ("ok", {"err": 6})
    assert elapsed < 30


def test_child_loop_keeps_the_tail_of_a_long_error(capsys):
    from tkit.bench.isolate import child_loop

    long = "CUDA error: misaligned address " + "explanation " * 100 + "reproduce: f(x)"

    def check(name):
        raise RuntimeError(long)

    child_loop(["a"], check)
    bad = [line for line in capsys.readouterr().out.splitlines() if line.startswith("BAD a ")]
    assert len(bad) == 1 and len(bad[0]) <= 1010
    assert "misaligned address" in bad[0] and bad[0].endswith("reproduce: f(x)")
