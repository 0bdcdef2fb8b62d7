"""Packaging: one version, stated lower bounds that the test environment really runs, a wheel that installs and
works outside the checkout (``tfdebug --help`` and the demo), and every install line the README and the docs print,
run as printed in a fresh virtual environment."""

from __future__ import annotations

import importlib.metadata
import os
import re
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.version import Version

import lightning_tfdebug
from lightning_tfdebug.__main__ import main
from tests.test_docs_commands import BLOCKS, commands

tomllib = pytest.importorskip("tomllib")  # Python 3.11+; these checks need not run on 3.10
ROOT = Path(__file__).resolve().parents[1]
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
LOWER_BOUNDS = ROOT / ".ci" / "lower-bounds.txt"


def requirements() -> dict[str, Requirement]:
    project = PYPROJECT["project"]
    reqs = [Requirement(r) for r in project["dependencies"]]
    reqs += [Requirement(r) for r in project["optional-dependencies"]["test"]]
    return {r.name: r for r in reqs}


def lower_bound(req: Requirement) -> Version:
    bounds = [Version(s.version) for s in req.specifier if s.operator == ">="]
    assert bounds, f"{req} states no lower bound (>=)"
    return bounds[0]


def test_the_version_is_defined_once():
    assert "version" not in PYPROJECT["project"], "pyproject.toml repeats the version; it lives in __init__.py"
    assert "version" in PYPROJECT["project"]["dynamic"]
    attr = PYPROJECT["tool"]["setuptools"]["dynamic"]["version"]["attr"]
    assert attr == "lightning_tfdebug.__version__"
    Version(lightning_tfdebug.__version__)  # a valid PEP 440 version
    literal = re.compile(r"\b\d+\.\d+\.\d+(\.dev\d+)?\b")
    init = (ROOT / "lightning_tfdebug" / "__init__.py").read_text()
    assert len(literal.findall(init)) == 1, "lightning_tfdebug/__init__.py should hold the one version literal"
    # the installed metadata (editable or wheel) agrees with the source
    assert importlib.metadata.version("lightning-tfdebug") == lightning_tfdebug.__version__


def test_tfdebug_version_prints_the_version_of_the_package(capsys):
    with pytest.raises(SystemExit) as exited:
        main(["--version"])
    assert exited.value.code == 0
    assert capsys.readouterr().out == f"lightning-tfdebug {lightning_tfdebug.__version__}\n"
    assert importlib.metadata.version("lightning-tfdebug") == lightning_tfdebug.__version__  # what pyproject.toml gave


def test_supported_versions_are_stated_and_ci_runs_the_lower_bounds():
    reqs = requirements()
    pinned = {}
    for line in LOWER_BOUNDS.read_text().splitlines():
        line = line.split("#")[0].strip()
        if line:
            name, version = line.split("==")
            pinned[name.strip()] = Version(version)
    for name in ("torch", "lightning", "pytorch-lightning", "torchmetrics", "tensorboard"):
        assert name in reqs, f"{name} is not a dependency"
        assert pinned.get(name) == lower_bound(reqs[name]), (
            f".ci/lower-bounds.txt pins {name}=={pinned.get(name)}, pyproject.toml's lower bound is "
            f"{lower_bound(reqs[name])}: keep them in step"
        )
        installed = Version(importlib.metadata.version(name))
        assert reqs[name].specifier.contains(installed, prereleases=True), f"{name} {installed} outside {reqs[name]}"
        if os.environ.get("TFDEBUG_LOWER_BOUNDS"):  # CI installs exactly the lower bounds
            assert installed.release == pinned[name].release, f"CI should run {name}=={pinned[name]}, has {installed}"
    python = PYPROJECT["project"]["requires-python"]
    assert python.startswith(">="), python
    assert sys.version_info >= tuple(int(p) for p in python[2:].split("."))
    page = (ROOT / "docs" / "installation.md").read_text()
    for name in ("Python", "torch", "lightning", "pytorch_lightning", "torchmetrics"):
        assert name in page
    for name in ("lightning", "torch", "torchmetrics"):
        assert str(lower_bound(reqs[name])) in page, f"docs/installation.md does not state {name}'s lower bound"


def test_ci_runs_what_a_user_installs_and_the_lower_bounds_in_a_lane_of_its_own():
    """`.ci/run`'s main lane is the README's set-up: bootstrap with no constraints (the newest versions the bounds
    allow), then the README's test command; its lower lane pins .ci/lower-bounds.txt in a second venv."""
    script = (ROOT / ".ci" / "run").read_text()
    main_lane = script.split("main_lane() {", 1)[1].split("\n}", 1)[0]
    lower_lane = script.split("lower_lane() {", 1)[1].split("\n}", 1)[0]
    readme = (ROOT / "README.md").read_text()
    tests_line = re.search(r"^bash scripts/bootstrap\.sh && (\S.*?)\s+# the tests$", readme, re.M)
    assert tests_line, "README.md no longer has its `bash scripts/bootstrap.sh && ... # the tests` line"
    assert "unset PIP_CONSTRAINT" in main_lane and "bash scripts/bootstrap.sh" in main_lane
    assert tests_line.group(1) in main_lane, f"the main lane does not run the README's `{tests_line.group(1)}`"
    assert "mkdocs build --strict" in main_lane and "ruff check" in main_lane
    assert 'PIP_CONSTRAINT="$PWD/.ci/lower-bounds.txt"' in lower_lane and "TFDEBUG_LOWER_BOUNDS=1" in lower_lane
    assert "VENV=.ci/venv-lower" in lower_lane and "-m pytest" in lower_lane


def _copy_sources(dest: Path) -> None:
    """The files git would ship (tracked and untracked-not-ignored), so nothing is built inside the checkout."""
    listed = subprocess.run(
        ["git", "ls-files", "-co", "--exclude-standard"], cwd=ROOT, capture_output=True, text=True, check=True
    ).stdout.split("\n")
    for rel in filter(None, listed):
        src = ROOT / rel
        if src.is_file():
            (dest / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dest / rel)


def _venv_borrowing_dependencies(venv: Path, *, with_pip: bool) -> tuple[Path, Path]:
    """A fresh venv (its python and its site-packages) that sees this environment's packages, offline, except this
    package and pip: a directory of links to them, after the venv's own site-packages (a plain path: this
    environment's .pth files, among them the editable install of the checkout, are not processed). pip in the venv
    then finds torch & co. installed and downloads nothing for them, but installs lightning-tfdebug for real."""
    subprocess.run(
        [sys.executable, "-m", "venv", str(venv)] + ([] if with_pip else ["--without-pip"]), check=True, timeout=120
    )
    python = venv / "bin" / "python"
    site = Path(
        subprocess.run(
            [python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
    )
    deps = venv.parent / f"{venv.name}-deps"
    deps.mkdir()
    for where in dict.fromkeys(Path(sysconfig.get_paths()[k]) for k in ("purelib", "platlib")):
        for entry in where.iterdir():
            name = entry.name.lower()
            own = name.startswith(("lightning_tfdebug", "__editable__", "pip-")) or name == "pip"
            if not (own or name.endswith(".pth") or name == "__pycache__" or (deps / entry.name).exists()):
                (deps / entry.name).symlink_to(entry)
    (site / "deps.pth").write_text(f"{deps}\n")
    return python, site


@pytest.mark.slow
def test_the_wheel_installs_and_runs_outside_the_checkout(tmp_path):
    """Build a wheel (not editable), install it into a fresh venv that borrows this environment's dependencies
    (offline), then run ``tfdebug --help`` and 20 steps of the demo from a directory outside the checkout."""
    src, dist, venv, work = (tmp_path / d for d in ("src", "dist", "venv", "work"))
    _copy_sources(src)
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(dist), str(src)],
        check=True,
        timeout=300,
    )
    wheels = list(dist.glob("lightning_tfdebug-*.whl"))
    assert len(wheels) == 1, wheels
    assert lightning_tfdebug.__version__ in wheels[0].name
    python, site = _venv_borrowing_dependencies(venv, with_pip=False)
    subprocess.run(
        [sys.executable, "-m", "pip", "--python", str(python), "install", "--no-deps", "--no-index", "-q", wheels[0]],
        check=True,
        timeout=300,
    )
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    work.mkdir()
    where = subprocess.run(
        [python, "-c", "import lightning_tfdebug as t; print(t.__file__, t.__version__)"],
        cwd=work,
        env=env,
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert where.startswith(str(site)), f"imported from {where!r}, not from the wheel in {site}"
    assert lightning_tfdebug.__version__ in where
    assert (site / "lightning_tfdebug" / "py.typed").exists()

    helped = subprocess.run(
        [venv / "bin" / "tfdebug", "--help"], cwd=work, env=env, capture_output=True, text=True, timeout=120
    )
    assert helped.returncode == 0, helped.stderr
    assert "replay" in helped.stdout

    for name in ("train.py", "demo.yaml"):
        shutil.copy2(ROOT / "examples" / name, work / name)
    demo = subprocess.run(
        [python, "train.py", "fit", "--config", "demo.yaml", "--trainer.max_steps", "20"],
        cwd=work,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert demo.returncode == 0, demo.stdout[-3000:] + demo.stderr[-3000:]
    logs = list((work / "runs" / "demo").glob("version_*/tfdebug/findings-rank0.jsonl"))
    assert logs, "the demo wrote no findings file"  # TFD410 (info) is written on every 32-bit run


@pytest.mark.slow
@pytest.mark.parametrize("block", [b for b in BLOCKS if b.kind == "install"], ids=lambda b: b.id)
def test_the_printed_install_lines_install_the_package(block, tmp_path):
    """Each ``docs-test: install`` block of the README and the docs, run as printed in the root of a copy of the
    checkout, with a fresh venv's bin first on ``PATH`` (its ``pip``, its ``python``) and no ``PYTHONPATH``: the
    package then imports from that venv and its ``tfdebug --version`` is the source's version."""
    clone, venv, work = (tmp_path / d for d in ("clone", "venv", "work"))
    _copy_sources(clone)
    python, site = _venv_borrowing_dependencies(venv, with_pip=True)
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}
    env["VIRTUAL_ENV"], env["PATH"] = str(venv), f"{venv / 'bin'}{os.pathsep}{env.get('PATH', '')}"
    script = "set -e\n" + "\n".join(commands(block.code)) + "\n"
    done = subprocess.run(["bash", "-c", script], cwd=clone, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, f"{block.id}:\n{script}\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"

    work.mkdir()
    where = subprocess.run(
        [python, "-c", "import lightning_tfdebug as t; print(t.__file__)"],
        cwd=work,
        env=env,
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert where.startswith(str(site)), f"{block.id}: imported from {where!r}, not from the venv's {site}"
    version = subprocess.run(
        [venv / "bin" / "tfdebug", "--version"], cwd=work, env=env, capture_output=True, text=True, timeout=120
    )
    assert version.returncode == 0, version.stderr
    assert version.stdout == f"lightning-tfdebug {lightning_tfdebug.__version__}\n"
