"""AttentionProbe: attention entropy per layer at init, against the uniform entropy of each layer's mask."""

from lightning_tfdebug.callbacks.attention_probe.callback import AttentionProbe

__all__ = ["AttentionProbe"]
