"""MaskProbe's readings: what each probe measured (:class:`Reading` and its keys), and the settings every
decision shares (the steps the alignment and order checks retry at).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

from lightning_tfdebug.primitives.keys import Key

if TYPE_CHECKING:
    pass


Number = Any
"""A number of a reading: a device scalar (0-d tensor) while probing, a host float after :func:`on_host`."""

ALIGNMENT_RETRY_STEPS = (1, 5, 20, 50, 100, 200, 500)
"""Steps at which a target-alignment check that could not decide yet (losses of the two alignments too close on a
freshly initialised model) is tried again. Fixed, so every rank tries at the same steps."""

ORDER_STEPS = (100, 200, 500)
"""Steps at which the token-order check runs until it decides. Not before step 100: attention of a freshly initialised
model is nearly uniform, so its outputs hardly depend on token order even when positions reach it."""


def _beyond(change: float, tolerance: float) -> bool:
    return not change <= tolerance  # also NaN: a NaN output is not a clean pass


# ------------------------------------------------------------------------------------------------------- logged keys
_KEYS: list[Key] = []


def _key(name: str, description: str, unit: str = "") -> Key:
    """A MaskProbe key, added to :data:`KEYS` in the order defined."""
    _KEYS.append(Key(f"mask_probe/{name}", description, unit, chart="mask probes"))
    return _KEYS[-1]


REPEAT = _key("repeat_max_change", "largest logit difference between two forwards of the same tokens")
CAUSAL = _key("causal_max_change", "largest logit change at positions before the edited tokens")
PADDING = _key("padding_max_change", "largest real-token logit change when the ids under the mask change")
PAD_SIDE = _key("pad_side_max_change", "largest real-token logit change when padding is added on the pad side")
KV_CACHE = _key("kv_cache_max_change", "largest difference between incremental and full-forward logits")
LOSS_RETURNED = _key("loss_returned", "the loss `training_step` returned on the batch (eval mode, `no_grad`)", "nats")
LOSS_SHIFTED = _key("loss_shifted", "cross-entropy of the same logits, position t against label t+1", "nats")
LOSS_SHIFTED2 = _key("loss_shifted2", "the same, position t against label t+2", "nats")
LOSS_UNSHIFTED = _key("loss_unshifted", "the same, position t against label t", "nats")
CONTEXT_LIMIT = _key("context_limit", "the context limit the position probes used", "tokens")
ORDER = _key("order_change", "largest change of a position's output when the tokens before it are reversed")
CONTENT = _key("content_change", "largest change of that output when the tokens before it are replaced")
SECONDS = _key("seconds", "wall time of the probe", "s")
CROSS_SAMPLE = _key("cross_sample_max_change", "largest logit change of other samples when one sample's tokens change")
KEYS: tuple[Key, ...] = tuple(_KEYS)
"""Every scalar MaskProbe logs (on probing steps only): ``MaskProbe.KEYS``."""


# ----------------------------------------------------------------------------------------------------------- readings
@dataclass(frozen=True)
class Reading:
    """What one probe measured. ``LOGGED`` maps a field to the key it is logged under."""

    LOGGED: ClassVar[Mapping[str, Key]] = {}

    def logged(self) -> dict[str, float]:
        """The logged scalars of this reading (host numbers: after the transfer)."""
        return {key.name: float(getattr(self, f)) for f, key in self.LOGGED.items() if getattr(self, f) is not None}
