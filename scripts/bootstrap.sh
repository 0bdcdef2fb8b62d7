#!/usr/bin/env bash
# Create (or reuse) the project's virtual environment in .venv and install the package with its dev extras (tests,
# ruff, the docs site): the newest versions pyproject.toml's bounds allow, which is what CI's main lane runs. VENV picks
# another directory and PIP_CONSTRAINT pins versions (CI's lower lane: VENV=.ci/venv-lower with .ci/lower-bounds.txt).
# torch goes in first, pinned to a CPU build, so that resolving `lightning` never pulls a multi-GB CUDA build.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV="${VENV:-.venv}"
PY="${PYTHON:-python3}"
if [ ! -x "$VENV/bin/python" ]; then
  "$PY" -m venv "$VENV"
fi
# setuptools>=77 (the build backend) in the venv itself: tests/test_packaging.py builds the wheel offline
"$VENV/bin/python" -m pip install --quiet --upgrade pip "setuptools>=77"
if ! "$VENV/bin/python" -c "import torch" 2>/dev/null; then
  # TORCH_SPEC lets another machine choose its build, e.g. TORCH_SPEC="torch==2.13.0+cpu".
  "$VENV/bin/python" -m pip install --quiet "${TORCH_SPEC:-torch==2.13.0}"
fi
"$VENV/bin/python" -m pip install --quiet -e ".[dev]"
"$VENV/bin/python" -c "import torch, lightning, lightning_tfdebug; print('torch', torch.__version__, '| lightning', lightning.__version__, '| lightning_tfdebug', lightning_tfdebug.__version__)"
