"""The distribution as users get it: a wheel built from the repository, installed in a fresh venv and
run from a folder outside the checkout, runs every task family and gives the same table as the
editable install of the same tree.

The new venv reaches the dependencies through a .pth file naming this interpreter's site-packages:
that folder joins sys.path but its own .pth files (the editable install's finder among them) are not
run, and the wheel installed into the venv comes first on sys.path, so the venv imports its own copy.
"""

from __future__ import annotations

import os
import shutil
import site
import subprocess
import sys
import zipfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
LONGBENCH_FIXTURES = REPO / "tests" / "fixtures" / "longbench"
MODEL = "tiny-gla"  # an embedded model: its name must resolve from the installed package data
# The smallest grid that touches every family: S-NIAH and both perplexity protocols in one run, one
# LongBench dataset of the shipped fixtures in a second (LongBench takes --limit, not cells).
RUNS = (
    ["-t", "s-niah-1", "-t", "ppl", "--lengths", "1k", "--depths", "50", "--samples-per-cell", "1"],
    ["-t", "ccq_longbench_trec", "--limit", "1", "--longbench-dir", str(LONGBENCH_FIXTURES)],
)
EXPECTED_TASKS = {"ccq_s_niah_1", "ccq_ppl_buckets", "ccq_ppl_sweep", "ccq_longbench_trec"}
SUBPROCESS_TIMEOUT_S = 600
# What the distribution is built from (pyproject.toml names the rest of the tree nowhere).
SOURCES = ("pyproject.toml", "README.md", "ccq_eval", "tasks", "models")
REPORT_TEMPLATES = REPO / "ccq_eval" / "analysis" / "templates"


def _environment() -> dict[str, str]:
    """Offline, one thread per process (the two installs run side by side), no user site, nothing that
    points imports or task folders at the checkout."""
    env = {key: value for key, value in os.environ.items()
           if key not in ("PYTHONPATH", "CCQ_EVAL_TASKS_DIR", "VIRTUAL_ENV", "PYTHONHOME")}
    return env | {"PYTHONNOUSERSITE": "1", "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1",
                  "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}


def _run(command: list[str | Path], cwd: Path) -> str:
    done = subprocess.run([str(part) for part in command], cwd=cwd, env=_environment(), capture_output=True,
                          text=True, timeout=SUBPROCESS_TIMEOUT_S, check=False)
    output_tail = (done.stdout + done.stderr)[-3000:]
    assert done.returncode == 0, f"{' '.join(map(str, command))} failed in {cwd}:\n{output_tail}"
    return done.stdout


def _build_wheel(folder: Path) -> Path:
    """The wheel of a copy of the sources: setuptools' build/ folder then holds no file of an earlier
    build, and nothing is written into the checkout."""
    source = folder / "source"
    source.mkdir()
    for name in SOURCES:
        if (REPO / name).is_dir():
            shutil.copytree(REPO / name, source / name, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            shutil.copy2(REPO / name, source / name)
    _run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "--no-index",
          "-w", folder, source], cwd=folder)
    [wheel] = folder.glob("ccq_eval-*.whl")
    return wheel


def _venv_with_wheel(folder: Path, wheel: Path) -> Path:
    """A fresh venv with the wheel installed; returns its bin/ folder."""
    _run([sys.executable, "-m", "venv", "--without-pip", "--system-site-packages", folder], cwd=folder.parent)
    python = folder / "bin" / "python"
    venv_site = Path(_run([python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                          cwd=folder).strip())
    (venv_site / "test_interpreter_site.pth").write_text("\n".join(site.getsitepackages()) + "\n")
    _run([python, "-m", "pip", "install", "-q", "--no-deps", "--no-index", "--ignore-installed", wheel],
         cwd=folder)
    return folder / "bin"


def _module_file(python: Path | str, module: str, cwd: Path) -> Path:
    return Path(_run([python, "-c", f"import {module} as m; print(m.__file__)"], cwd=cwd).strip())


def _grid_table(ccq_eval: list[str | Path], workdir: Path) -> tuple[str, str]:
    """`ccq-eval run` of RUNS into workdir/out, then its table: (tidy CSV, markdown)."""
    workdir.mkdir()
    for run in RUNS:
        _run([*ccq_eval, "run", "-m", MODEL, *run, "-o", "out", "--lm-eval-arg", "bootstrap_iters=0",
              "--no-report", "--quiet"], cwd=workdir)
    tidy = _run([*ccq_eval, "table", "out", "--format", "csv", "--view", "tidy"], cwd=workdir)
    return tidy, _run([*ccq_eval, "table", "out"], cwd=workdir)


@pytest.mark.slow
def test_wheel_in_a_fresh_venv_runs_every_task_family_like_the_editable_install(tmp_path):
    wheel_dir = tmp_path / "wheel"
    wheel_dir.mkdir()
    wheel = _build_wheel(wheel_dir)
    # Only the package at the top level: no `cli` or `tasks` module of ours in site-packages.
    top_level = {name.split("/")[0] for name in zipfile.ZipFile(wheel).namelist()}
    assert {name for name in top_level if not name.endswith(".dist-info")} == {"ccq_eval"}
    # The report's templates are package data: `ccq-eval report` loads them from the installed package.
    templates = {f"ccq_eval/analysis/templates/{path.name}" for path in REPORT_TEMPLATES.iterdir()}
    assert templates and templates <= set(zipfile.ZipFile(wheel).namelist())

    venv_bin = _venv_with_wheel(tmp_path / "venv", wheel)
    outside = tmp_path / "elsewhere"
    outside.mkdir()
    for module in ("ccq_eval", "ccq_eval.tasks.s_niah.utils", "ccq_eval.models"):
        assert _module_file(venv_bin / "python", module, outside).is_relative_to(tmp_path / "venv"), module
        assert _module_file(sys.executable, module, outside).is_relative_to(REPO), module

    # The wheel through its console script, the editable install through `python -m ccq_eval`, side by side.
    with ThreadPoolExecutor(max_workers=2) as pool:
        installed = pool.submit(_grid_table, [venv_bin / "ccq-eval"], outside / "wheel")
        editable = pool.submit(_grid_table, [sys.executable, "-m", "ccq_eval"], outside / "editable")
        installed_tidy, installed_table = installed.result()
        editable_tidy, editable_table = editable.result()

    tasks = {line.split(",")[1] for line in editable_tidy.splitlines()[1:]}
    assert tasks == EXPECTED_TASKS, editable_tidy
    assert installed_tidy == editable_tidy
    assert installed_table == editable_table
