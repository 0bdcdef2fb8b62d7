"""Draw the report figures of ``docs/report.md`` from the demo run, so that they can be regenerated.

Usage::

    python scripts/gen_report_figures.py                      # run the demo with its LR 100x too high, then draw
    python scripts/gen_report_figures.py --log-dir RUN_DIR    # draw from a run already on disk
    python scripts/gen_report_figures.py --keep DIR           # run the demo under DIR (kept), then draw

The demo is ``examples/train.py fit --config examples/demo.yaml`` with ``--model.lr 0.1`` (the demo's LR is 1e-3)
for 120 steps, written under a temporary directory. Written: ``docs/images/report-overview.svg`` (the training loss
with every warning and error marked), ``docs/images/report-evidence.svg`` (the evidence chart of the first warning or
error whose rule has a chart of its own), and the text report (one headline per finding) between
``<!-- headlines -->`` and ``<!-- /headlines -->`` in ``docs/report.md``.
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

IMAGES = ROOT / "docs" / "images"
DEMO_ARGS = ("--model.lr", "0.1", "--trainer.max_steps", "120", "--trainer.enable_progress_bar", "false")


def run_demo(root: Path) -> Path:
    """Run the demo under ``root``; return its log directory."""
    cmd = [sys.executable, str(ROOT / "examples" / "train.py"), "fit", "--config", str(ROOT / "examples" / "demo.yaml")]
    cmd += [*DEMO_ARGS, "--trainer.default_root_dir", str(root), "--trainer.logger.init_args.save_dir", str(root)]
    subprocess.run(cmd, check=True, cwd=root)
    return next((root / "demo").glob("version_*"))


def draw(log_dir: Path, shown_as: str = "runs/demo/version_0") -> list[Path]:
    from lightning_tfdebug.report import load_run, render
    from lightning_tfdebug.report.evidence import finding_figure, overview_figure
    from lightning_tfdebug.report.run import read_series

    run = load_run(log_dir)
    series = read_series(run.log_dir)
    merged = run.merged
    IMAGES.mkdir(parents=True, exist_ok=True)
    page = ROOT / "docs" / "report.md"
    written = [IMAGES / "report-overview.svg", IMAGES / "report-evidence.svg", page]
    written[0].write_text(overview_figure(run, series, merged).svg + "\n", encoding="utf-8")
    from lightning_tfdebug.rules import RULES

    # the first warning or error whose rule draws a chart of its own (else the first: the loss around its step)
    flagged = sorted((m for m in merged if m.severity != "info"), key=lambda m: RULES[m.code].chart is None)
    if flagged:
        written[1].write_text(finding_figure(flagged[0], series).svg + "\n", encoding="utf-8")
    text = render(run, "text").replace(str(run.log_dir), shown_as)
    block = f"<!-- headlines -->\n```text\n{text}```\n<!-- /headlines -->"
    page.write_text(re.sub(r"<!-- headlines -->.*?<!-- /headlines -->", lambda _: block, page.read_text(), flags=re.S))
    return written


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--log-dir", help="draw from this run instead of running the demo")
    parser.add_argument("--keep", help="run the demo under this directory and keep it (default: a temporary one)")
    args = parser.parse_args(argv)
    if args.log_dir:
        written = draw(Path(args.log_dir))
    elif args.keep:
        Path(args.keep).mkdir(parents=True, exist_ok=True)
        written = draw(run_demo(Path(args.keep).resolve()))
    else:
        with tempfile.TemporaryDirectory() as tmp:
            written = draw(run_demo(Path(tmp)))
    for path in written:
        print(f"wrote {path.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
