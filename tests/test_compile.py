"""The whole pack on a model whose forward is compiled (inductor, CPU): the run finishes, and the pack adds no
recompiles (counted with Dynamo's own counters) and blames none on the user (TFD606/TFD607)."""

from __future__ import annotations

import warnings

import pytest
import torch

from lightning_tfdebug import TFDebugWarning
from lightning_tfdebug.demo import TinyGPT, TinyTextDataModule
from tests.helpers import SMALL, make_trainer

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1200)]  # inductor on 2 shared CPU cores: minutes per run


class CompiledGPT(TinyGPT):
    """TinyGPT whose forward is compiled with inductor, as a user would: ``self.forward = torch.compile(...)``."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.forward = torch.compile(self.forward)


def dynamo_counts() -> dict[str, float]:
    from torch._dynamo.utils import counters

    from lightning_tfdebug.functional.throughput import compile_counts

    graphs, limit_hits = compile_counts()
    return {"graphs": graphs, "limit_hits": limit_hits, "frames_ok": float(counters["frames"]["ok"])}


def compiled_run(tmp_path, callbacks, steps: int = 10) -> tuple[dict[str, float], object]:
    import torch._dynamo

    torch._dynamo.reset()  # fresh caches and counters: each run counts its own compiles
    from torch._dynamo.utils import counters

    counters.clear()
    torch.manual_seed(0)
    trainer = make_trainer(tmp_path, callbacks, max_steps=steps, log_every_n_steps=4)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", TFDebugWarning)
        trainer.fit(CompiledGPT(**SMALL), TinyTextDataModule(batch_size=8))
    return dynamo_counts(), trainer


def test_the_whole_pack_adds_no_recompile_to_a_compiled_forward(tmp_path):
    from lightning_tfdebug.pack import TFDebug

    bare, trainer = compiled_run(tmp_path / "bare", [])
    assert trainer.global_step == 10
    pack = TFDebug(preset="full", every_n_steps=4, summary=False)
    counts, trainer = compiled_run(tmp_path / "pack", [pack])
    print(f"compiled forward, 10 steps: without the pack {bare}, with the whole pack {counts}")
    assert trainer.global_step == 10 and trainer.state.finished
    assert counts["limit_hits"] in (0.0,) and bare["limit_hits"] in (0.0,)
    assert counts["graphs"] == bare["graphs"], (bare, counts)
    codes = {f.code for f in pack.findings}
    assert not codes & {"TFD606", "TFD607"}, codes
    assert "TFD343" in codes  # DeadActivation says it cannot observe compiled code, and stands aside
