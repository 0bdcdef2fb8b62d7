"""What ``TFDebug()`` (the default preset) says today on the cases of issue 43: the healthy runs of
``tests/healthy_models.KIND_FAMILIES`` and the bug rows on them (rows 36, 42, 43, 51 and 52 of ``tests/bug_matrix``).

Usage: ``PYTHONPATH=. python tests/scripts/kind_baseline.py [OUT.jsonl]``; one JSON line per case: its findings as
``code severity @step``.
"""

from __future__ import annotations

import json
import sys
import tempfile
import warnings
from pathlib import Path

from lightning_tfdebug import TFDebug
from tests.healthy_models import KIND_FAMILIES, build, data
from tests.helpers import make_trainer
from tests.test_bug_matrix import CASES
from tests.test_healthy_matrix import STEPS

ROWS = (36, 42, 43, 51, 52)
NEW_FAMILIES = (*KIND_FAMILIES, "tinygpt", "gpt2")


def fit(module, loader, steps: int) -> tuple[list[str], str | None]:
    pack = TFDebug()
    with tempfile.TemporaryDirectory() as tmp:
        trainer = make_trainer(Path(tmp), [pack], max_steps=steps, log_every_n_steps=10)
        error = None
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            try:
                trainer.fit(module, loader)
            except Exception as err:  # recorded, the baseline goes on
                error = f"{type(err).__name__}: {err}"
    return [f"{f.code} {f.severity} @{f.step}" for f in pack.findings], error


def main() -> None:
    with open(sys.argv[1], "w") if len(sys.argv) > 1 else sys.stdout as out:
        run(out)


def run(out) -> None:
    for family in KIND_FAMILIES:
        found, error = fit(build(family), data(family), STEPS[family])
        out.write(json.dumps({"case": f"healthy/{family}", "steps": STEPS[family], "said": found, "error": error}))
        out.write("\n")
        out.flush()
    for (row, family), case in CASES.items():
        if row in ROWS and family in NEW_FAMILIES and not (row == 36 and family != "seq2seq_reverse"):
            found, error = fit(case.module(), case.data(), case.steps)
            out.write(json.dumps({"case": f"row{row}-{family}", "steps": case.steps, "said": found, "error": error}))
            out.write("\n")
            out.flush()


if __name__ == "__main__":
    main()
