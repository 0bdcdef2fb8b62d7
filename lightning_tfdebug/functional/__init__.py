"""Pure tensor math used by the callbacks: no Trainer, no host sync."""

from lightning_tfdebug.functional.norms import group_sums, grouped_sq_norms, per_tensor_norms

__all__ = ["group_sums", "grouped_sq_norms", "per_tensor_norms"]
