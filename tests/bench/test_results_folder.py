"""benchmarks/results holds the long-form files, their generated README and RUNS.md only (issue
#19: raw logs and per-run files are not committed), and what docs, tutorials and the README
name there exists: a ``benchmarks/results/<file>`` path names a file of the folder, a run id
(``h200-2026-11-29-b-matmul``, or a prefix of one such as ``h200-2026-11-29-b``) names rows of
a long-form file."""

from __future__ import annotations

import fnmatch
import json
import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "benchmarks" / "results"
FIXED = {"README.md", "RUNS.md", ".gitignore"}
#: <device>.jsonl (timings) and <device>-checks.jsonl (records that time nothing): no date
LONG_FORM = re.compile(r"^(?!.*\d{4}-\d{2}-\d{2})[a-z0-9]+(?:-[a-z0-9]+)*\.jsonl$")
PATH_REF = re.compile(r"benchmarks/results/([^\s`'\"()\[\],;:]*)")
RUN_REF = re.compile(r"(?<![\w/.-])h200-\d{4}-\d{2}-\d{2}-[a-z]+(?:-[a-z0-9_]+)*")


def _folder_files() -> list[str]:
    """The folder's files as git will commit them (tracked, and untracked but not ignored); the
    directory listing where there is no git checkout."""
    try:
        out = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard",
                              "--", "benchmarks/results"], cwd=ROOT, capture_output=True,
                             text=True, check=True).stdout
        deleted = subprocess.run(["git", "ls-files", "--deleted", "--", "benchmarks/results"],
                                 cwd=ROOT, capture_output=True, text=True, check=True).stdout
        names = set(out.split()) - set(deleted.split())
        return sorted(n.removeprefix("benchmarks/results/") for n in names)
    except (OSError, subprocess.CalledProcessError):
        return sorted(p.relative_to(RESULTS).as_posix() for p in RESULTS.rglob("*")
                      if p.is_file())


def _long_form_files() -> list[Path]:
    return [RESULTS / n for n in _folder_files() if LONG_FORM.match(n)]


def _referring_files() -> list[Path]:
    return ([ROOT / "README.md"] + sorted((ROOT / "docs").rglob("*.md"))
            + sorted((ROOT / "tutorials").glob("*.py")))


def test_results_folder_holds_only_the_long_form_files_and_their_readmes():
    names = _folder_files()
    stray = [n for n in names if n not in FIXED and not LONG_FORM.match(n)]
    assert not stray, (
        f"benchmarks/results holds files other than the long-form <device>.jsonl / "
        f"<device>-checks.jsonl, README.md and RUNS.md: {stray[:20]} ({len(stray)} in all). "
        "Fold their rows into the long-form file (tkit.bench.report.append_long_form), "
        "put their conclusions in docs/NOTES.md, delete them, and regenerate the README "
        "(python -m tkit.bench.report --readme)")
    assert FIXED <= set(names) and _long_form_files()


def test_long_form_rows_are_json_objects_with_a_run_id():
    for path in _long_form_files():
        for i, line in enumerate(path.read_text().splitlines(), 1):
            if line.strip():
                row = json.loads(line)
                assert isinstance(row, dict) and row.get("run") and "op" in row, (path.name, i)


def test_references_to_result_files_and_runs_resolve():
    names = _folder_files()
    runs = {json.loads(ln)["run"] for p in _long_form_files()
            for ln in p.read_text().splitlines() if ln.strip()}
    bad = []
    for path in _referring_files():
        text = path.read_text()
        rel = path.relative_to(ROOT).as_posix()
        for m in PATH_REF.finditer(text):
            ref = m.group(1).rstrip(".")
            if not ref or "<" in ref:
                continue  # the folder itself, or a template such as <device>.jsonl
            if not (ref in names or any(fnmatch.fnmatch(n, ref) for n in names)):
                bad.append(f"{rel}: benchmarks/results/{ref}")
        for m in RUN_REF.finditer(text):
            ref = m.group(0)
            if not any(r == ref or r.startswith(ref + "-") for r in runs):
                bad.append(f"{rel}: run {ref}")
    assert not bad, ("references to result files or run ids that the long-form files in "
                     f"benchmarks/results do not hold: {bad}")


def test_readme_heads_each_device_by_the_name_its_rows_give(tmp_path):
    """A device's section is named by the newest row that names a device, even where the rows
    after it (a probe's, ingested without one) do not."""
    from tkit.bench.report import readme_text

    rows = [dict(run="h200-2026-01-01-a-x", device="NVIDIA H200", op="add", case="c",
                 provider="tkit", median_ms=1.0),
            dict(run="h200-2026-01-01-b-probe", op="add", case="c", provider="tkit",
                 median_ms=1.0, source="a probe")]
    (tmp_path / "h200.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    text = readme_text(tmp_path)
    assert "## NVIDIA H200 (`h200.jsonl`)" in text, text
