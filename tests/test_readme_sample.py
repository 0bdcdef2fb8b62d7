"""The sample finding at the top of the README is what the program prints: a real run with the bug of the sample
(the LM head left out of the optimizer) prints the same text, numbers aside."""

from __future__ import annotations

import re
from pathlib import Path

from lightning_tfdebug import UpdateRatio
from lightning_tfdebug.demo import TinyGPT
from tests.helpers import SMALL, fit_tiny

README = Path(__file__).resolve().parents[1] / "README.md"


def readme_sample() -> str:
    text = README.read_text()
    start = text.index("```text\n[TFD") + len("```text\n")
    return text[start : text.index("```", start)]


def comparable(text: str) -> str:
    """Whitespace collapsed (the README wraps long lines) and every number replaced by #."""
    return re.sub(r"-?\d+(\.\d+)?(e-?\d+)?", "#", " ".join(text.split()))


def test_the_readme_sample_is_what_a_real_run_prints(tmp_path):
    monitor = UpdateRatio(every_n_steps=1)
    fit_tiny(tmp_path, [monitor], TinyGPT(head_not_in_optimizer=True, **SMALL), max_steps=8)
    [finding] = [f for f in monitor.findings if f.code == "TFD312"]
    assert comparable(finding.format()) == comparable(readme_sample())
