"""tkit profile: the parser of ncu's raw CSV, each branch of the diagnosis, the ncu command,
the runner end to end through a stand-in ncu, the CLI's errors, and (GPU with ncu) a real
profile of an op."""

from __future__ import annotations

import os
import stat
import subprocess
import sys

import pytest

from tkit.profile import diagnose, ncu_command, parse_raw_csv, profile, report
from tkit.profile.metrics import METRICS, stall_metric

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

#: ncu --csv --page raw as it prints: the program's own output first, then a header of
#: columns, a row of units, a row a kernel (values quoted, thousands separated)
_COLS = ["dram_pct", "sm_pct", "duration_ns", "grid", "sms", "occupancy_pct"]
FIXTURE = "\n".join([
    "==PROF== Connected to process 4242 (python3)",
    "some output of the profiled program",
    ",".join(f'"{c}"' for c in ["ID", "Process ID", "Process Name", "Host Name", "Kernel Name",
                                "Context", "Stream", "Block Size", "Grid Size", "Device", "CC"]
             + [METRICS[c] for c in _COLS] + [stall_metric("long_scoreboard"),
                                              stall_metric("barrier")]),
    ",".join(['""'] * 11 + ['"%"', '"%"', '"nsecond"', '""', '""', '"%"', '"inst"', '"inst"']),
    ",".join(['"0"', '"4242"', '"python3"', '"127.0.0.1"', '"_ew_flat_kernel"', '"1"', '"7"',
              '"(256, 1, 1)"', '"(65536, 1, 1)"', '"0"', '"9.0"', '"91.2"', '"23.5"',
              '"184,688"', '"65,536"', '"132"', '"88.1"', '"12.5"', '"0.4"']),
    ",".join(['"1"', '"4242"', '"python3"', '"127.0.0.1"', '"_splitk_reduce"', '"1"', '"7"',
              '"(128, 1, 1)"', '"(64, 1, 1)"', '"0"', '"9.0"', '"3.1"', '"n/a"', '"2,048"',
              '"64"', '"132"', '"10.5"', '"1.5"', '"6.0"']),
    "==PROF== Disconnected from process 4242",
])


def test_the_raw_csv_is_parsed_with_units_and_separators():
    ks = parse_raw_csv(FIXTURE)
    assert [k["kernel"] for k in ks] == ["_ew_flat_kernel", "_splitk_reduce"]
    a, b = ks
    assert a["duration_ns"] == 184688 and a["grid"] == 65536 and a["dram_pct"] == 91.2
    assert a["stalls"] == {"long_scoreboard": 12.5, "barrier": 0.4}
    assert "sm_pct" not in b  # n/a is absent, not 0
    with pytest.raises(ValueError, match="no ncu raw CSV header"):
        parse_raw_csv("==PROF== nothing was profiled\n")


def _kinds(k):
    return [f.kind for f in diagnose(k)]


def test_the_tree_from_grid_to_bound_to_stalls():
    mem = dict(grid=4096, sms=132, dram_pct=91, sm_pct=20,
               stalls={"long_scoreboard": 9.0, "barrier": 1.0, "selected": 1.0})
    f = diagnose(mem)
    assert f[0].kind == "bound" and "at the roofline" in f[0].text
    assert f[1].kind == "stall" and f[1].text.startswith("long_scoreboard: 90%")
    assert "at the roofline" not in diagnose({**mem, "dram_pct": 70})[0].text
    # the grid comes first: 64 programs leave 68 SMs idle
    assert _kinds({**mem, "grid": 64})[0] == "grid"
    # 1.2 waves: the last runs 20% full
    assert "last wave" in diagnose({**mem, "grid": 158})[0].text
    tc = diagnose(dict(grid=4096, sms=132, dram_pct=30, sm_pct=80, gmma_pct=75))
    assert "tensor cores (75%" in tc[0].text
    cuda_cores = diagnose(dict(grid=4096, sms=132, dram_pct=30, sm_pct=80, tensor_pct=5))
    assert "CUDA cores" in cuda_cores[0].text


def test_latency_bound_names_occupancy_and_its_limit():
    k = dict(grid=4096, sms=132, dram_pct=20, sm_pct=15, occupancy_pct=12,
             occupancy_limit_pct=18.75, registers=255, shared_bytes=98304,
             stalls={"barrier": 5.0, "long_scoreboard": 3.0, "wait": 1.0, "mio_throttle": 0.5})
    f = diagnose(k)
    assert [x.kind for x in f] == ["bound", "occupancy", "stall", "stall", "stall"]
    assert "latency-bound" in f[0].text
    assert "255 registers" in f[1].text and "96 KB" in f[1].text
    assert f[2].text.startswith("barrier") and "warp specialization" in f[2].text
    assert report({**k, "kernel": "k", "duration_ns": 1500}).startswith("k: 1.5 us\n  [bound]")


def test_the_ncu_command_profiles_the_childs_range_at_the_machines_clocks():
    cmd = ncu_command("/x/ncu", "rms_norm", 2, kernel="rms")
    assert cmd[0] == "/x/ncu" and cmd[-4:] == ["-m", "tkit.profile.child", "rms_norm", "2"]
    assert cmd[cmd.index("--clock-control") + 1] == "none"
    assert cmd[cmd.index("--nvtx-include") + 1] == "tkit_profile/"
    assert "regex:rms" in cmd and "--csv" in cmd
    assert METRICS["dram_pct"] in cmd[cmd.index("--metrics") + 1]


def test_profile_runs_ncu_and_parses_it(tmp_path):
    # a stand-in ncu that prints what ncu prints: the runner's subprocess path end to end
    data = tmp_path / "out.csv"
    data.write_text(FIXTURE)
    fake = tmp_path / "ncu"
    fake.write_text(f"#!/bin/sh\ncat {data}\n")
    fake.chmod(fake.stat().st_mode | stat.S_IEXEC)
    ks = profile("add", ncu=str(fake))
    assert [k["kernel"] for k in ks] == ["_ew_flat_kernel", "_splitk_reduce"]
    # a metric this ncu does not know: named in its error, dropped, asked again
    gmma = METRICS["gmma_pct"]
    fake.write_text(f"#!/bin/sh\ncase \"$*\" in *{gmma}*) echo '==ERROR== Failed to find "
                    f"metric {gmma}' >&2; exit 1;; esac\ncat {data}\n")
    assert len(profile("add", ncu=str(fake))) == 2
    fake.write_text("#!/bin/sh\necho 'ERR: profiling is not supported' >&2\nexit 3\n")
    with pytest.raises(RuntimeError, match="ncu exited 3: ERR"):
        profile("add", ncu=str(fake))


def test_the_cli_says_what_is_missing():
    env = {**os.environ, "PATH": "/nonexistent", "TKIT_NCU": "/nonexistent/ncu"}
    run = [sys.executable, "-m", "tkit.cli", "profile"]
    r = subprocess.run(run + ["add", "--ncu", "/nonexistent/ncu"], capture_output=True,
                       text=True, env=env, cwd=ROOT)
    if os.path.exists("/usr/local/cuda/bin/ncu"):
        pytest.skip("this machine has ncu where the search looks last")
    assert r.returncode == 1 and "ncu) not found" in r.stderr
    r = subprocess.run(run + ["no_such_op"], capture_output=True, text=True, env=env, cwd=ROOT)
    assert r.returncode == 2 and "unknown op" in r.stderr


@pytest.mark.gpu
def test_a_real_profile_gpu():
    from tkit.profile import find_ncu

    try:
        find_ncu()
    except RuntimeError as e:
        pytest.skip(str(e))
    ks = profile("add")
    assert ks and ks[0]["duration_ns"] > 0 and "dram_pct" in ks[0]
    assert diagnose(ks[0])[0].kind in ("grid", "bound")
