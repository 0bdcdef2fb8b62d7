"""lightning_tfdebug: PyTorch Lightning callbacks that find out why a transformer run breaks."""

from lightning_tfdebug.callbacks.grad_norm_monitor import GradNormMonitor
from lightning_tfdebug.callbacks.update_ratio import UpdateRatio
from lightning_tfdebug.core.base import DebugCallback, TFDebugWarning
from lightning_tfdebug.findings import Finding, TFDebugError, read_findings

# --- issue 3: numerics ---
# --- issue 4: activations and loss at init ---
# --- issue 5: throughput and ranks ---
# --- issue 6: batches and repro ---
# --- issue 7: masks, optimizer, checkpoints ---

__version__ = "0.1.0.dev0"

__all__ = [
    "DebugCallback",
    "Finding",
    "GradNormMonitor",
    "TFDebugError",
    "TFDebugWarning",
    "UpdateRatio",
    "read_findings",
    # --- issue 3 names ---
    # --- issue 4 names ---
    # --- issue 5 names ---
    # --- issue 6 names ---
    # --- issue 7 names ---
]
