"""The whole pack on a model whose forward is compiled (inductor, CPU): the run finishes, the pack adds at most one
recompile, early (counted with Dynamo's own counters), and blames none on the user (TFD606/TFD607)."""

from __future__ import annotations

import warnings

import lightning.pytorch as pl
import pytest
import torch

from lightning_tfdebug import TFDebugWarning
from lightning_tfdebug.demo import TinyGPT, TinyTextDataModule
from tests.helpers import SMALL, make_trainer

pytestmark = pytest.mark.timeout(600)  # inductor compiles the tiny model in 5-20 s on 2 CPU cores


class CompiledGPT(TinyGPT):
    """TinyGPT whose forward is compiled with inductor, as a user would: ``self.forward = torch.compile(...)``."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.forward = torch.compile(self.forward)


def dynamo_counts() -> dict[str, float]:
    from torch._dynamo.utils import counters

    from lightning_tfdebug.core.host import compile_counts

    graphs, limit_hits = compile_counts()
    return {"graphs": graphs, "limit_hits": limit_hits, "frames_ok": float(counters["frames"]["ok"])}


class GraphsPerStep(pl.Callback):
    """Dynamo's compiled-graph count after every training batch (host counters, no sync)."""

    def __init__(self):
        self.graphs: list[float] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.graphs.append(dynamo_counts()["graphs"])


def compiled_run(tmp_path, callbacks, steps: int = 10) -> tuple[dict[str, float], list[float], pl.Trainer]:
    import torch._dynamo

    torch._dynamo.reset()  # fresh caches and counters: each run counts its own compiles
    from torch._dynamo.utils import counters

    counters.clear()
    torch.manual_seed(0)
    per_step = GraphsPerStep()
    trainer = make_trainer(tmp_path, [per_step, *callbacks], max_steps=steps, log_every_n_steps=4)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", TFDebugWarning)
        trainer.fit(CompiledGPT(**SMALL), TinyTextDataModule(batch_size=8))
    return dynamo_counts(), per_step.graphs, trainer


def test_the_whole_pack_adds_no_recompile_to_a_compiled_forward(tmp_path):
    """The whole pack (preset "full": MaskProbe, eager NaNFirstFrame, DeadActivation, CheckpointAudit...) but
    LossAtInit, on a compiled forward: MaskProbe's probes and every replay run eagerly (no graph); DeadActivation
    stands aside (TFD343); NaNFirstFrame falls back to lazy mode. Not one graph more than the bare run."""
    from lightning_tfdebug.pack import TFDebug

    bare, bare_steps, trainer = compiled_run(tmp_path / "bare", [])
    assert trainer.global_step == 10
    pack = TFDebug(preset="full", every_n_steps=4, summary=False, exclude=["LossAtInit"])
    counts, steps, trainer = compiled_run(tmp_path / "pack", [pack])
    print(f"compiled forward, 10 steps: without the pack {bare} {bare_steps}; with the pack {counts} {steps}")
    assert trainer.global_step == 10 and trainer.state.finished
    assert counts["limit_hits"] == 0.0 and bare["limit_hits"] == 0.0
    assert counts["graphs"] == bare["graphs"] and steps == bare_steps, (bare_steps, steps)
    codes = {f.code for f in pack.findings}
    assert not codes & {"TFD606", "TFD607"}, codes
    assert "TFD343" in codes  # DeadActivation says it cannot observe compiled code, and stands aside
    assert "TFD208" in codes  # MaskProbe's position check ran (at the limit, never past it)


def test_the_whole_pack_with_loss_at_init_on_a_compiled_forward(tmp_path):
    from lightning_tfdebug.pack import TFDebug

    bare, _, _ = compiled_run(tmp_path / "bare", [])
    pack = TFDebug(preset="full", every_n_steps=4, summary=False)
    counts, steps, trainer = compiled_run(tmp_path / "pack", [pack])
    print(f"compiled forward with LossAtInit: {counts} {steps}")
    assert trainer.global_step == 10 and counts["limit_hits"] == 0.0
    assert counts["graphs"] == bare["graphs"], steps
    # LossAtInit read the step-0 logits from an eager replay: it measured, it did not stand aside
    member = pack.members["LossAtInit"]
    assert member.active and "TFD228" not in {f.code for f in member.findings}
    assert member._run.vocab is not None
