"""One fit of the tiny transformer with ThroughputMonitor on a machine loaded on purpose, in a process of its own (its
priority is lowered, which cannot be undone inside the test process). Usage: ``loaded_run.py SPEC.json``; prints the
findings as one JSON line.

Spec keys: ``steps``; ``monitor`` (ThroughputMonitor's arguments); ``at``: from this step on, busy loops keep twice
the cores busy and this process runs at ``nice`` (a smaller share of each core, whatever else loads the machine: the
contention is controlled); ``grow``: from this step on, the run's own work grows (every step's logits kept, a
statistic over all of them recomputed); ``without_proc``: ``/proc`` unread (macOS); ``threads``: torch threads.
"""

import json
import os
import sys
import warnings

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from lightning_tfdebug import ThroughputMonitor
from lightning_tfdebug.core import host
from lightning_tfdebug.demo import TinyGPT, TinyTextDataModule
from tests.helpers import SMALL, BusyLoops, make_trainer


class Loaded(TinyGPT):
    def __init__(self, at: int | None, nice: int, grow: int | None, **kwargs):
        super().__init__(**kwargs)
        self.at, self.nice, self.grow = at, nice, grow
        self.seen: list[torch.Tensor] = []

    def training_step(self, batch, batch_idx):
        step = self.trainer.global_step
        if step == self.at and self.nice:
            os.nice(self.nice)
            self.nice = 0
        logits = self(batch["input_ids"], batch.get("attention_mask"))
        if self.grow is not None and step >= self.grow:
            self.seen.append(logits.detach().repeat(3, 1, 1))
            with torch.no_grad():
                self.log("confidence", torch.cat(self.seen).softmax(-1).amax(-1).mean())
        return self.loss(logits, batch["labels"])


def main() -> None:
    with open(sys.argv[1]) as f:
        spec = json.load(f)
    if spec.get("without_proc"):
        host.thread_run_delays = host.thread_run_delay_ns = lambda: None
    torch.set_num_threads(spec.get("threads", torch.get_num_threads()))
    at = spec.get("at")
    load = BusyLoops(at=at) if at is not None else None
    monitor = ThroughputMonitor(**spec.get("monitor", {}))
    model = Loaded(at, spec.get("nice", 0), spec.get("grow"), **SMALL)
    callbacks = [monitor] + ([load] if load is not None else [])
    trainer = make_trainer(os.path.dirname(sys.argv[1]), callbacks, max_steps=spec["steps"])
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            trainer.fit(model, TinyTextDataModule(batch_size=8))
    finally:
        if load is not None:
            load.stop()
    findings = [{"code": f.code, "step": f.step, "evidence": f.evidence} for f in monitor.findings]
    print("loaded-run: " + json.dumps(findings, default=float), flush=True)


if __name__ == "__main__":
    main()
