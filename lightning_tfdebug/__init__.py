"""lightning_tfdebug: PyTorch Lightning callbacks that find out why a transformer run breaks."""

from lightning_tfdebug.core.base import DebugCallback, TFDebugWarning
from lightning_tfdebug.findings import Finding, TFDebugError, read_findings

__version__ = "0.1.0.dev0"

__all__ = [
    "DebugCallback",
    "Finding",
    "TFDebugError",
    "TFDebugWarning",
    "read_findings",
]
