"""The rules ReproCapture decides: each finding code with its severity, text and hint."""

from __future__ import annotations

from lightning_tfdebug.functional.verdicts import Rule

TFD130 = Rule(
    "TFD130",
    "info",
    "ReproCapture",
    title="training failed; a bundle was written (the message has its path and the replay command)",
    trigger="training raised an exception; a repro bundle was written (path in the message)",
    hint="`python -m lightning_tfdebug replay <bundle> --config <your LightningCLI config>`",
    reason=(
        "The failure itself propagates as the exception; the finding only points at the bundle written to reproduce it"
    ),
)

TFD131 = Rule(
    "TFD131",
    "warning",
    "ReproCapture",
    title="the bundle could not be written; the original exception propagates unchanged",
    trigger=("the bundle could not be written (disk full, no permission); the original exception still propagates"),
    hint="Check free disk space and write permission on the log directory.",
    reason="Loses work: the evidence needed to replay the crash is gone, though the crash itself still propagates",
)

BLOCK = ("TFD130", "TFD139")
"""The codes reserved for ReproCapture's rules."""

RULES: tuple[Rule, ...] = (
    TFD130,
    TFD131,
)
"""The rules decided in this module, in code order."""
