"""The contract suite's settings table (``tests/test_contract.py``): one row per callback of the pack and one for
:class:`~lightning_tfdebug.TFDebug`.

A row says how to build the callback for a run on the tiny model, on which tiny run it has something to say (its
fixture), and the few facts about its arguments that a signature cannot tell (which numbers may be zero or negative,
which arguments accept anything, more bad values to try). A new callback is covered by adding one row; the suite
fails while a member of :data:`lightning_tfdebug.pack.MEMBERS` has none.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn

from lightning_tfdebug.demo import TinyGPT
from lightning_tfdebug.pack import MEMBERS, TFDebug

EVERY = 2
"""The measuring cadence of every row that has one: a tiny run of a dozen steps measures several times."""


# ------------------------------------------------------------------ tiny runs
@dataclass(frozen=True)
class Fixture:
    """A tiny run: ``model_class(**SMALL, **model)`` on ``TinyTextDataModule(batch_size=8, **data)`` for ``steps``
    optimizer steps. ``raises``: the bug ends the fit with this exception (alone and in the pack alike);
    ``resumable``: its last checkpoint can be resumed (a checkpoint without optimizer state cannot)."""

    model: Mapping[str, Any] = field(default_factory=dict)
    data: Mapping[str, Any] = field(default_factory=dict)
    steps: int = 12
    model_class: type = TinyGPT
    raises: type[BaseException] | None = None
    resumable: bool = True


class UnusedParameterGPT(TinyGPT):
    """TinyGPT with a trainable layer the forward never calls: its parameters never receive a gradient."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.unused = nn.Linear(4, 4)


class FloatTensorBatchGPT(TinyGPT):
    """Batches that are one plain float tensor (the token ids as floats): nothing a callback can read ids from."""

    def on_after_batch_transfer(self, batch: Any, dataloader_idx: int) -> Tensor:
        return batch["input_ids"].float()

    def training_step(self, batch: Tensor, batch_idx: int) -> Tensor:
        ids = batch.long()
        return self.loss(self(ids), ids)


class FeaturesOnlyGPT(TinyGPT):
    """Batches that are dicts of one float tensor under a name no reader knows: no token ids, no labels."""

    def on_after_batch_transfer(self, batch: Any, dataloader_idx: int) -> dict[str, Tensor]:
        return {"features": batch["input_ids"].float()}

    def training_step(self, batch: dict[str, Tensor], batch_idx: int) -> Tensor:
        ids = batch["features"].long()
        return self.loss(self(ids), ids)


class FeaturesAndTargetsGPT(TinyGPT):
    """Batches that are dicts without token ids: float ``features`` and integer ``target`` labels (with -100 at the
    padding), as a classifier's or a regression model's batch would be, under names no reader knows."""

    def on_after_batch_transfer(self, batch: Any, dataloader_idx: int) -> dict[str, Tensor]:
        return {"features": batch["input_ids"].float(), "target": batch["labels"]}

    def training_step(self, batch: dict[str, Tensor], batch_idx: int) -> Tensor:
        return self.loss(self(batch["features"].long()), batch["target"])


class OutOfMemoryGPT(TinyGPT):
    """TinyGPT whose training step raises ``torch.OutOfMemoryError`` at step 3, as the allocator would on a device
    too small for that batch."""

    def training_step(self, batch: dict[str, Tensor], batch_idx: int) -> Tensor:
        if self.trainer.global_step == 3:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB.")
        return super().training_step(batch, batch_idx)


FIXTURES: dict[str, Fixture] = {
    "healthy": Fixture(steps=16),
    "head_not_in_optimizer": Fixture(model={"head_not_in_optimizer": True}),
    "padding_supervised": Fixture(data={"pad_labels_supervised": True}, steps=6),
    "no_causal_mask": Fixture(model={"no_causal_mask": True}, steps=4),
    "softmax_output": Fixture(model={"softmax_output": True}, steps=4),
    "nan_module": Fixture(model={"nan_module": "blocks.0.mlp.fc", "nan_at_step": 3}, steps=6, resumable=False),
    "dead_relu": Fixture(model={"activation": "relu", "mlp_bias_init": -5.0}, steps=16),
    "unused_parameter": Fixture(model_class=UnusedParameterGPT, steps=8),
    "no_optimizer_state": Fixture(model={"drop_optimizer_state": True}, steps=5, resumable=False),
    "bad_token_id": Fixture(data={"bad_token_every": 3}, steps=5, raises=IndexError, resumable=False),
    "out_of_memory": Fixture(model_class=OutOfMemoryGPT, steps=5, raises=torch.OutOfMemoryError, resumable=False),
}

UNREADABLE: dict[str, Fixture] = {
    "float_tensor_batch": Fixture(model_class=FloatTensorBatchGPT, steps=6),
    "dict_of_features": Fixture(model_class=FeaturesOnlyGPT, steps=6),
    "dict_of_features_and_targets": Fixture(model_class=FeaturesAndTargetsGPT, steps=6),
}
"""Runs whose batches no callback can read: each must stand aside (once) or say nothing, and the fit must finish."""

DDP_FIXTURE = Fixture(
    model={"head_not_in_optimizer": True, "no_causal_mask": True}, data={"pad_labels_supervised": True}, steps=6
)
"""The one 2-rank run of the whole pack: bugs for four members at once (UpdateRatio, OptimizerAudit, MaskProbe,
BatchGuard), so that every rank has findings to agree on."""


# ------------------------------------------------------------------ the table
ZERO_OK = frozenset({"input_key", "mask_key", "labels_key", "ignore_index", "bos_id", "eos_id"})
"""Arguments of every callback that has them for which 0 is valid: where the batch holds a tensor (a name or a tuple
position) and token ids (0 is a token)."""
NEGATIVE_OK = frozenset({"ignore_index"})
"""Arguments of every callback that has them that accept any integer (``ignore_index`` is -100 by default)."""


@dataclass(frozen=True)
class Row:
    """How the contract suite builds and judges one callback.

    Attributes:
        kwargs: constructor arguments for a run on the tiny model (JSON values: they also go to the 2-rank run).
        fixture: the tiny run (:data:`FIXTURES`) on which it has a finding: the same findings alone and in the pack
            are asserted there; ``"healthy"`` for a callback with no finding on any simple run (its info findings on
            the healthy run are compared).
        expect: codes it must find alone on its fixture, so that the comparison with the pack is not of two empty
            sets by accident.
        zero_ok: numeric arguments for which 0 is a valid value (every other one must refuse 0 and -1), beyond
            :data:`ZERO_OK`.
        negative_ok: numeric arguments that accept any integer, beyond :data:`NEGATIVE_OK`.
        anything: arguments that accept any value (typed ``Any``): no wrong type to try.
        bad: more bad values, ``(argument, value)``, that the signature cannot derive (a regex that does not compile,
            an unknown member name, a range given backwards).
        xfail: ``check -> the bug, one sentence``: a check this row fails today because of a bug in the callback (a
            check: a name in ``test_contract.CHECKS``, ``"bad_argument:<argument>=<value>"`` for one bad value, or
            ``"unreadable:<batch>"`` for one of :data:`UNREADABLE`).
    """

    kwargs: Mapping[str, Any] = field(default_factory=dict)
    fixture: str = "healthy"
    expect: frozenset[str] = frozenset()
    zero_ok: frozenset[str] = frozenset()
    negative_ok: frozenset[str] = frozenset()
    anything: frozenset[str] = frozenset()
    bad: tuple[tuple[str, Any], ...] = ()
    xfail: Mapping[str, str] = field(default_factory=dict)


ROWS: dict[str, Row] = {
    "ReproCapture": Row(
        fixture="bad_token_id",
        expect=frozenset({"TFD130"}),
        zero_ok=frozenset({"max_state_mb"}),  # 0: capture no module state, only the batch
    ),
    "BatchGuard": Row(
        kwargs={"every_n_steps": EVERY},
        fixture="padding_supervised",
        expect=frozenset({"TFD115"}),
        zero_ok=frozenset({"max_truncated_fraction", "decode_examples", "special_token_batches"}),
        anything=frozenset({"tokenizer"}),
        bad=(
            ("schema", {"input_ids": "float99"}),
            ("tokenizer", "no.such_module.Tokenizer"),
            ("input_key", ""),
        ),
    ),
    "MaskProbe": Row(
        kwargs={"every_n_steps": EVERY},
        fixture="no_causal_mask",
        expect=frozenset({"TFD201"}),
        bad=(("kv_cache_fn", "no.such_module:decode"), ("forward_fn", "no.such_module:forward")),
    ),
    "LossAtInit": Row(
        kwargs={"every_n_steps": EVERY, "check_step": 14},  # its stall and copy checks run in the healthy run too
        fixture="softmax_output",
        expect=frozenset({"TFD220"}),
        zero_ok=frozenset({"label_smoothing"}),
    ),
    "NaNFirstFrame": Row(
        fixture="nan_module",
        expect=frozenset({"TFD401"}),
        zero_ok=frozenset({"max_reports"}),  # 0: find the frame, write no report
    ),
    "GradNormMonitor": Row(
        kwargs={"every_n_steps": EVERY},
        fixture="unused_parameter",
        expect=frozenset({"TFD304"}),
        bad=(("groups", {"blocks": "[("}),),
    ),
    "ScalerWatch": Row(kwargs={"every_n_steps": EVERY}),  # fp16 AMP does not run on this CPU: TFD410 (info) only
    "UpdateRatio": Row(
        kwargs={"every_n_steps": EVERY},
        fixture="head_not_in_optimizer",
        expect=frozenset({"TFD312"}),
        zero_ok=frozenset({"decayed_lr_fraction"}),
        bad=(("low", 1.0), ("groups", {"blocks": "[("})),  # low above high
    ),
    "OptimizerAudit": Row(
        kwargs={"every_n_steps": EVERY},
        fixture="head_not_in_optimizer",
        expect=frozenset({"TFD320"}),
        zero_ok=frozenset({"zero_lr_fraction"}),
    ),
    "DeadActivation": Row(
        kwargs={"every_n_steps": EVERY},
        fixture="dead_relu",
        expect=frozenset({"TFD340"}),
        bad=(("layers", "[("), ("preactivations", {"blocks.0.mlp.fc": "softplus9"})),
    ),
    "ThroughputMonitor": Row(
        kwargs={"every_n_steps": EVERY},  # its regressions need a long quiet run: no fixture in a dozen steps
        zero_ok=frozenset({"skip_steps"}),
        bad=(("profile_steps", (5, 2)), ("profile_steps", (-1, 3)), ("length_fn", "no.such_module:length")),
    ),
    "PerRankLogger": Row(
        kwargs={"every_n_steps": EVERY},
        fixture="nan_module",
        expect=frozenset({"TFD505"}),
        zero_ok=frozenset({"straggler_min_ms"}),
    ),
    "CheckpointAudit": Row(
        kwargs={"every_n_steps": EVERY},
        fixture="no_optimizer_state",
        expect=frozenset({"TFD703", "TFD705"}),
    ),
    # a tiny run never stalls: the healthy fixture, silent; its stalls are tested in test_stall_watchdog.py
    "StallWatchdog": Row(bad=(("abort_exit_code", 256),)),
}
ROWS["MemoryWatch"] = Row(
    kwargs={"every_n_steps": EVERY},
    fixture="out_of_memory",
    expect=frozenset({"TFD621"}),
)
# a tiny healthy run never spikes (and is shorter than the warm-up): silent; its spikes are tested in
# tests/callbacks/test_spike_guard.py and bug-matrix row 47
ROWS["SpikeGuard"] = Row(
    bad=(("on_spike", "stop"), ("min_ratio", 0.5)), zero_ok=frozenset({"max_skips", "max_bundles"})
)
# AttentionProbe: TinyGPT's attention is fused (SDPA), so every tiny run records its check aside and says nothing
ROWS["AttentionProbe"] = Row()
ROWS["TFDebug"] = Row(
    kwargs={"preset": "full", "overrides": {name: dict(row.kwargs) for name, row in ROWS.items() if row.kwargs}},
    fixture="head_not_in_optimizer",
    anything=frozenset({"tokenizer"}),
    bad=(
        ("include", ["NoSuchMember"]),
        ("exclude", ["NoSuchMember"]),
        ("exclude", "GradNormMonitor"),  # a string, not a list of names
        ("overrides", {"NoSuchMember": {}}),
        ("overrides", {"GradNormMonitor": {"no_such_argument": 1}}),
    ),
    xfail={},
)
"""``TFDebug``'s row: the whole pack (``preset="full"``), each member configured as in its own row; the pack of
every fixture run is this one, so a member alone and in the pack differ only by the pack and the preset's own settings
(``full`` runs NaNFirstFrame in eager mode; alone it is lazy, and must find the same)."""

CLASSES: dict[str, type] = {**MEMBERS, "TFDebug": TFDebug}


def build(name: str) -> Any:
    """The callback of row ``name``, built from its row."""
    return CLASSES[name](**ROWS[name].kwargs)


def ddp_extra(trainer: Any, model: Any, callbacks: list) -> dict[str, Any]:
    """For ``tests/scripts/dist_run.py``: per rank, which members failed in their own code and which stood aside."""
    members = {n: m for cb in callbacks for n, m in getattr(cb, "members", {type(cb).__name__: cb}).items()}
    return {
        "failed": {n: m.failure["error"] for n, m in members.items() if m.failure is not None},
        "stood_aside": sorted(n for n, m in members.items() if m.stood_aside is not None),
    }
