"""How many ``torch.distributed`` collectives the pack makes, step by step (issue 25), with real gloo groups.

Every rank of a real DDP fit (``tests/scripts/dist_run.py``) counts each collective called from Python, outermost
call only (``all_gather_object`` runs an ``all_gather`` inside: one call), and files it under the optimizer step in
progress: from the batch's arrival (``on_after_batch_transfer``, just before ``on_train_batch_start``) to the next
batch's. Calls before the first batch are "setup", after the last "end". DDP's gradient all-reduce runs in C++ (the
reducer) and is not counted: only what the pack, Lightning and the model call from Python is.
"""

from __future__ import annotations

import functools
import sys
import threading
from collections import defaultdict
from pathlib import Path
from typing import Any

import pytest

from lightning_tfdebug.demo import TinyGPT
from tests.helpers import SMALL, run_distributed

_COLLECTIVES = (
    "all_reduce",
    "all_gather",
    "all_gather_into_tensor",
    "all_gather_object",
    "broadcast",
    "broadcast_object_list",
    "reduce",
    "gather",
    "gather_object",
    "scatter",
    "scatter_object_list",
    "reduce_scatter",
    "reduce_scatter_tensor",
    "all_to_all",
    "all_to_all_single",
    "barrier",
    "monitored_barrier",
)
_STATE: dict[str, Any] = {"step": "setup", "calls": defaultdict(list), "installed": False}
_DEPTH = threading.local()


def _origin() -> str:
    """The innermost frame of the pack (``file:line function``) that led to this call, else Lightning's, else ``?``."""
    frame = sys._getframe(2)
    lightning = None
    while frame is not None:
        name = frame.f_code.co_filename
        if "/lightning_tfdebug/" in name and not name.endswith("core/distributed.py"):
            return f"{Path(name).name}:{frame.f_lineno} {frame.f_code.co_name}"
        if lightning is None and "/lightning/" in name:
            lightning = f"lightning/{Path(name).name}:{frame.f_lineno} {frame.f_code.co_name}"
        frame = frame.f_back
    return lightning or "?"


def _counting(name: str, fn: Any) -> Any:
    @functools.wraps(fn)
    def counted(*args: Any, **kwargs: Any) -> Any:
        depth = getattr(_DEPTH, "n", 0)
        if depth == 0:
            _STATE["calls"][str(_STATE["step"])].append(f"{name} <- {_origin()}")
        _DEPTH.n = depth + 1
        try:
            return fn(*args, **kwargs)
        finally:
            _DEPTH.n = depth

    counted._tfdebug_counted = True  # type: ignore[attr-defined]
    return counted


def install_counters() -> None:
    """Wrap every collective of ``torch.distributed`` (and of ``distributed_c10d``, where they live) in this process."""
    if _STATE["installed"]:
        return
    import torch.distributed as dist
    import torch.distributed.distributed_c10d as c10d

    for name in _COLLECTIVES:
        original = getattr(c10d, name, None)
        if original is None or getattr(original, "_tfdebug_counted", False):
            continue
        wrapped = _counting(name, original)
        setattr(c10d, name, wrapped)
        if getattr(dist, name, None) is original:
            setattr(dist, name, wrapped)
    _STATE["installed"] = True


class CountingGPT(TinyGPT):
    """TinyGPT that counts, in its process, the collectives of each optimizer step."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        install_counters()

    def on_after_batch_transfer(self, batch: Any, dataloader_idx: int) -> Any:
        if self.trainer.training:
            _STATE["step"] = self.trainer.global_step  # the optimizer step this batch trains
        return super().on_after_batch_transfer(batch, dataloader_idx)

    def on_train_end(self) -> None:
        _STATE["step"] = "end"


def counts_extra(trainer: Any, model: Any, callbacks: Any) -> dict[str, Any]:
    from lightning_tfdebug import TFDebug

    packs = [c for c in callbacks if isinstance(c, TFDebug)]
    # float64 slots each rank sent in the pack's last shared reduction (a measuring step)
    slots = packs[0]._reduction.last_slots if packs else None
    return {"calls": dict(_STATE["calls"]), "slots": slots}


def count_collectives(tmp_path: Path, devices: int, callbacks: list[dict[str, Any]], steps: int = 12, **spec: Any):
    """Every rank's ``{step: [call, ...]}`` for a DDP fit of ``steps`` optimizer steps."""
    spec = {
        "strategy": "ddp",
        "devices": devices,
        "model_class": "tests.test_collectives:CountingGPT",
        "model": dict(SMALL),
        "data": {"batch_size": 4},
        "trainer": {"max_steps": steps, "log_every_n_steps": 50},
        "callbacks": callbacks,
        "extra": "tests.test_collectives:counts_extra",
        **spec,
    }
    results = run_distributed(tmp_path, spec, timeout=400)
    for r in results:
        assert r["error"] is None, r["error"]
        # a healthy run: the shared reduction's decisions (replicas compared through agreement sums included) are
        # silent
        found = [f for findings in r["findings"].values() for f in findings]
        assert [f"{f['code']} {f['message']}" for f in found if f["severity"] in ("warning", "error")] == []
    for r in results:
        print(f"rank {r['rank']}: the pack's shared reduction sent {r['extra']['slots']} float64 slots")
    return [r["extra"]["calls"] for r in results]


def per_step(calls: dict[str, list[str]], steps: int) -> dict[int, list[str]]:
    return {s: calls.get(str(s), []) for s in range(steps)}


ALWAYS = [{"class_path": "lightning_tfdebug.TFDebug", "init_args": {"preset": "always", "every_n_steps": 5}}]
STEPS = 12  # measuring steps 0, 5 and 10
#: Collectives of the pack on a measuring step (after the first): the pack's one all_reduce, into which every member
#: of the preset that needs other ranks' values declares (UpdateRatio, LossAtInit, DeadActivation, ThroughputMonitor
#: and PerRankLogger; GradNormMonitor and ScalerWatch need none under DDP).
MEASURING = ["all_reduce <- reduction.py"]


def pack_calls(made: list[str]) -> list[str]:
    """The calls the pack made (Lightning's own are left out), as ``function <- file``."""
    return [call.split(":")[0] for call in made if "<- lightning/" not in call]


@pytest.mark.ddp
@pytest.mark.timeout(900)
@pytest.mark.parametrize("devices", [2, pytest.param(4, marks=pytest.mark.slow)])  # 4 ranks: ~20 s
def test_no_collective_between_measuring_steps_and_few_on_one(tmp_path, devices):
    """``TFDebug(preset="always", every_n_steps=5)`` under DDP: no collective of the pack on a step that does not
    measure; on a measuring step only the ones listed in MEASURING. Lightning's own per-step SIGTERM broadcast
    (``training_epoch_loop._broadcast_sigterm_tensor``, every step of every multi-process fit) is not the pack's."""
    ranks = count_collectives(tmp_path, devices, ALWAYS, steps=STEPS)
    for rank, calls in enumerate(ranks):
        for step, made in per_step(calls, STEPS).items():
            print(f"rank {rank} step {step}: {len(made)} {made}")
            ours = pack_calls(made)
            if step % 5:
                assert ours == [], (rank, step, made)
            elif step > 0:
                assert ours == MEASURING, (rank, step, made)
        # every rank runs the same collectives in the same order
        assert {k: pack_calls(v) for k, v in calls.items()} == {k: pack_calls(v) for k, v in ranks[0].items()}
