"""The README's two commands, as a user runs them: the test command is what CI runs, and the
main command is run here in a fresh virtual environment."""

import os
import re
import shutil
import subprocess
import sysconfig
import venv
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
E2E = os.environ.get("TKIT_README_E2E") == "1"


def _commands() -> tuple[str, str]:
    """(main command, test command): the first bash block, and the one that runs pytest."""
    readme = (ROOT / "README.md").read_text()
    blocks = [b.strip() for b in re.findall(r"```bash\n(.*?)```", readme, flags=re.S)]
    return blocks[0], next(b for b in blocks if "pytest" in b)


def test_ci_runs_the_readme_commands():
    main, test = _commands()
    ci = (ROOT / ".ci" / "run").read_text()
    assert test in ci, f"README test command {test!r} is not what .ci/run runs"
    # the main command runs in test_readme_main_command_in_a_fresh_venv, which CI switches on
    assert "TKIT_README_E2E=1" in ci
    assert main.startswith("pip install -e ") and "tkit bench" in main


# Packages of the test environment that the new venv must not see: the main command installs
# no test extra, so tkit bench must work without them; tkit itself comes from the command.
_HIDDEN = re.compile(r"^(_?hypothesis|_?pytest|pluggy|iniconfig|tkit|__editable__)", re.I)


def _base_packages(dest: Path) -> Path:
    """A folder of links to this environment's packages (torch, triton, numpy...) minus the
    test-only ones: on the new venv's path, pip sees torch as installed and keeps it (no
    several-GB CUDA download) and keeps this environment's triton, the version under test."""
    dest.mkdir()
    seen = set()
    for key in ("purelib", "platlib"):
        site = Path(sysconfig.get_paths()[key])
        for entry in site.iterdir():
            if entry.name in seen or _HIDDEN.match(entry.name) or entry.suffix == ".pth":
                continue
            seen.add(entry.name)
            (dest / entry.name).symlink_to(entry)
    return dest


@pytest.mark.skipif(not E2E, reason="creates a venv and pip-installs the project (a minute or "
                                    "two, needs a package index): set TKIT_README_E2E=1, as "
                                    ".ci/run does")
@pytest.mark.skipif(torch.cuda.is_available(), reason="on a GPU tkit bench times every op for "
                                                      "minutes; this checks the CPU path")
def test_readme_main_command_in_a_fresh_venv(tmp_path):
    main, _ = _commands()
    src = tmp_path / "tkit"
    shutil.copytree(ROOT, src, ignore=shutil.ignore_patterns(
        ".git", "__pycache__", "*.egg-info", "build", ".pytest_cache", ".hypothesis"))
    env_dir = tmp_path / "venv"
    venv.create(env_dir, with_pip=True)
    py = env_dir / "bin" / "python"
    site = subprocess.run([py, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                          capture_output=True, text=True, check=True).stdout.strip()
    Path(site, "tkit-test-base.pth").write_text(str(_base_packages(tmp_path / "base")) + "\n")
    env = {k: v for k, v in os.environ.items()
           if k not in ("TRITON_INTERPRET", "PYTHONPATH", "PYTHONHOME")}
    env.update(PATH=f"{env_dir / 'bin'}{os.pathsep}{env.get('PATH', '')}",
               VIRTUAL_ENV=str(env_dir), PIP_DISABLE_PIP_VERSION_CHECK="1")
    out = subprocess.run(["bash", "-c", main], cwd=src, env=env, capture_output=True,
                         text=True, timeout=1200)
    log = out.stdout[-4000:] + out.stderr[-4000:]
    assert out.returncode == 0, log
    # tkit bench without a GPU says so and reports what it checked
    assert "timings need a CUDA GPU" in out.stdout, log
    m = re.search(r"^(\d+) passed, (\d+) failed", out.stdout, flags=re.M)
    assert m and int(m.group(1)) > 0 and m.group(2) == "0", log
    # the triton under test was kept, not replaced by what pip would pick
    import triton

    ver = subprocess.run([py, "-c", "import triton; print(triton.__version__)"], env=env,
                         capture_output=True, text=True, check=True).stdout.strip()
    assert ver == triton.__version__
