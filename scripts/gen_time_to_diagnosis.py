"""Write the time-to-diagnosis table of ``docs/time-to-diagnosis.md`` from a bug-matrix report.

The report is what the bug matrix writes with ``TFD_BUG_REPORT=PATH`` (one JSON line per finding: case, code,
severity, step). For every row of the bug zoo the table gives, per family, the first step at which a warning or an
error was raised, and the code that raised it.

Usage::

    TFD_BUG_REPORT=bug.jsonl python -m pytest -m "slow or not slow" tests/test_bug_matrix.py
    python scripts/gen_time_to_diagnosis.py bug.jsonl            # rewrites the table between the page's markers
    python scripts/gen_time_to_diagnosis.py bug.jsonl --check    # exit 1 when the page differs
"""

from __future__ import annotations

import json
import re
import sys
from collections import defaultdict
from pathlib import Path

PAGE = Path(__file__).resolve().parents[1] / "docs" / "time-to-diagnosis.md"
START, END = "<!-- time-to-diagnosis -->\n", "<!-- /time-to-diagnosis -->"


def first_flags(lines: list[str]) -> dict[str, tuple[int, str] | None]:
    """Per case: (step, code) of its first warning or error (the lowest code at that step), None when none."""
    found: dict[str, tuple[int, str] | None] = {}
    for line in lines:
        record = json.loads(line)
        case = record["case"]
        found.setdefault(case, None)
        if record["severity"] in ("warning", "error") and record.get("step") is not None:
            here = (int(record["step"]), record["code"])
            found[case] = here if found[case] is None or here < found[case] else found[case]
    return found


def table(found: dict[str, tuple[int, str] | None]) -> str:
    rows: dict[str, list[str]] = defaultdict(list)
    for case, flag in sorted(found.items()):
        row, _, family = case.partition("-")
        rows[row].append(f"{family}: " + ("not flagged" if flag is None else f"step {flag[0]} ({flag[1]})"))

    def order(row: str) -> tuple[int, str]:
        number = re.match(r"row(\d+)", row)
        return (int(number.group(1)) if number else 10**6, row)

    lines = ["| row | first warning or error, per family |", "| --- | --- |"]
    lines += [f"| {row} | {'; '.join(cells)} |" for row, cells in sorted(rows.items(), key=lambda kv: order(kv[0]))]
    return "\n".join(lines) + "\n"


def main() -> int:
    report, check = Path(sys.argv[1]), "--check" in sys.argv
    text = PAGE.read_text()
    new = text.split(START, 1)[0] + START + table(first_flags(report.read_text().splitlines())) + END
    new += text.split(END, 1)[1]
    if check:
        return int(new != text)
    PAGE.write_text(new)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
