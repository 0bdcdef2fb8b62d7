"""lightning_tfdebug: PyTorch Lightning callbacks that find out why a transformer run breaks."""

from lightning_tfdebug.callbacks.attention_probe import AttentionProbe
from lightning_tfdebug.callbacks.batch_guard.callback import BatchGuard
from lightning_tfdebug.callbacks.checkpoint_audit.callback import CheckpointAudit
from lightning_tfdebug.callbacks.dead_activation import DeadActivation
from lightning_tfdebug.callbacks.grad_norm_monitor import GradNormMonitor
from lightning_tfdebug.callbacks.loss_at_init import LossAtInit
from lightning_tfdebug.callbacks.mask_probe.callback import MaskProbe
from lightning_tfdebug.callbacks.memory_watch import MemoryWatch
from lightning_tfdebug.callbacks.nan_first_frame import NaNFirstFrame
from lightning_tfdebug.callbacks.optimizer_audit import OptimizerAudit
from lightning_tfdebug.callbacks.per_rank_logger import PerRankLogger
from lightning_tfdebug.callbacks.repro_capture import ReproCapture
from lightning_tfdebug.callbacks.scaler_watch import ScalerWatch
from lightning_tfdebug.callbacks.spike_guard.callback import SpikeGuard
from lightning_tfdebug.callbacks.stall_watchdog import StallWatchdog
from lightning_tfdebug.callbacks.throughput_monitor import ThroughputMonitor
from lightning_tfdebug.callbacks.update_ratio import UpdateRatio
from lightning_tfdebug.core.base import DebugCallback, TFDebugWarning
from lightning_tfdebug.findings import Finding, TFDebugError, read_findings
from lightning_tfdebug.pack import TFDebug

__version__ = "0.1.0.dev0"

__all__ = [
    "AttentionProbe",
    "BatchGuard",
    "CheckpointAudit",
    "DeadActivation",
    "DebugCallback",
    "Finding",
    "GradNormMonitor",
    "LossAtInit",
    "MaskProbe",
    "MemoryWatch",
    "NaNFirstFrame",
    "OptimizerAudit",
    "PerRankLogger",
    "ReproCapture",
    "ScalerWatch",
    "SpikeGuard",
    "StallWatchdog",
    "TFDebug",
    "TFDebugError",
    "TFDebugWarning",
    "ThroughputMonitor",
    "UpdateRatio",
    "read_findings",
]
