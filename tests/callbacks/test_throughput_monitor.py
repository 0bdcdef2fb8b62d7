import json
import math
import os
import signal
import subprocess
import sys
import time
import warnings

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from torch.utils.data import DataLoader

from lightning_tfdebug import PerRankLogger, ThroughputMonitor
from lightning_tfdebug.demo import TinyGPT, TinyTextDataModule
from tests.helpers import SMALL, make_trainer, read_csv_metrics, read_scalars, run_distributed
from tests.helpers import fit_tiny as fit


class TokenReference(pl.Callback):
    """Independent count: non-padding tokens (attention mask) and a wall-clock stamp at every optimizer-step end."""

    def __init__(self):
        self.tokens = 0
        self.positions = 0
        self.samples = 0
        self.ends: dict[int, float] = {}
        self.cumulative: dict[int, tuple[int, int]] = {}
        self.sample_counts: dict[int, int] = {}

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.step = trainer.global_step
        self.tokens += int(batch["attention_mask"].sum())
        self.positions += batch["attention_mask"].numel()
        self.samples += batch["attention_mask"].shape[0]

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if trainer.global_step != self.step:  # an optimizer step ended (not an accumulating micro-batch)
            self.ends[self.step] = time.perf_counter()
            self.cumulative[self.step] = (self.tokens, self.positions)
            self.sample_counts[self.step] = self.samples

    def window(self, a, b):
        """(tokens, positions, seconds) between the ends of optimizer steps a and b."""
        return (
            self.cumulative[b][0] - self.cumulative[a][0],
            self.cumulative[b][1] - self.cumulative[a][1],
            self.ends[b] - self.ends[a],
        )


def token_reference_results(trainer, model, callbacks):
    ref = next(c for c in callbacks if isinstance(c, TokenReference))
    return {"ends": ref.ends, "cumulative": ref.cumulative}


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"window": 0}, "window"),
        ({"wait_threshold": 0}, "wait_threshold"),
        ({"padding_threshold": 1.5}, "padding_threshold"),
        ({"regression_factor": 1.0}, "regression_factor"),
        ({"patience": 0}, "patience"),
        ({"memory_threshold": 0}, "memory_threshold"),
        ({"peak_flops": -1.0}, "peak_flops"),
        ({"profile_steps": (5, 5)}, "profile_steps"),
        ({"profile_steps": [3]}, "profile_steps"),
        ({"length_fn": "no_such_module_xyz.count"}, "could not be imported"),
        ({"length_fn": 3}, "length_fn"),
        ({"every_n_steps": 0}, "every_n_steps"),
        ({"mask_key": ["attention_mask"]}, "mask_key"),
        ({"labels_key": -1}, "labels_key"),
        ({"ignore_index": 1.5}, "ignore_index"),
    ],
)
def test_bad_arguments_fail_at_construction(kwargs, match):
    with pytest.raises((ValueError, TypeError), match=match):
        ThroughputMonitor(**kwargs)


def test_tokens_per_sec_matches_an_independent_count_and_keys_reach_loggers(tmp_path):
    reference, monitor = TokenReference(), ThroughputMonitor(every_n_steps=5)
    # 95 training documents, 11 batches an epoch: the window of steps 11-15 starts a new epoch (a new iterator)
    trainer = fit(tmp_path, [reference, monitor], data=TinyTextDataModule(batch_size=8, n_documents=100), max_steps=16)
    assert trainer.current_epoch >= 1
    scalars = read_scalars(tmp_path / "tb" / "version_0")
    logged = dict(scalars["throughput/tokens_per_sec"])
    assert sorted(logged) == [0, 5, 10, 15]
    for a, b in ((5, 10), (10, 15)):
        tokens, positions, seconds = reference.window(a, b)
        # same window, stamps taken microseconds apart by the two callbacks
        assert logged[b] == pytest.approx(tokens / seconds, rel=0.03)
        assert dict(scalars["throughput/padding_frac"])[b] == pytest.approx(1 - tokens / positions, abs=1e-6)
        assert dict(scalars["throughput/samples_per_sec"])[b] == pytest.approx(8 * 5 / seconds, rel=0.03)
    assert dict(scalars["throughput/tokens_per_sec_per_device"])[15] == pytest.approx(logged[15], rel=1e-6)
    for key in ("throughput/step_time_ms", "throughput/dataloader_wait_frac", "memory/peak_allocated_gib"):
        assert key in scalars
    assert dict(scalars["memory/reserved_gib"])[15] > 0.01  # process RSS on CPU
    assert 0 <= dict(scalars["throughput/dataloader_wait_frac"])[15] < 0.2
    assert "throughput/mfu" not in scalars  # CPU without peak_flops: no MFU
    rows = [r for r in read_csv_metrics(tmp_path / "csv" / "version_0") if r.get("throughput/tokens_per_sec")]
    assert [int(r["step"]) for r in rows] == [0, 5, 10, 15]
    assert monitor.findings == []


def count_supervised(batch):
    return (batch["labels"] != -100).sum()


def test_length_fn_by_import_path_and_gradient_accumulation_counts_every_micro_batch(tmp_path):
    reference = TokenReference()
    monitor = ThroughputMonitor(every_n_steps=3, length_fn="tests.callbacks.test_throughput_monitor.count_supervised")
    fit(tmp_path, [reference, monitor], max_steps=7, accumulate_grad_batches=2)
    logged = dict(read_scalars(tmp_path / "tb" / "version_0")["throughput/samples_per_sec"])
    assert sorted(logged) == [0, 3, 6]
    _, _, seconds = reference.window(3, 6)
    # 3 optimizer steps x 2 micro-batches x 8 samples
    assert logged[6] == pytest.approx(48 / seconds, rel=0.03)
    # labels equal the mask here, so the supervised count equals the non-padding count
    tokens, _, _ = reference.window(3, 6)
    assert dict(read_scalars(tmp_path / "tb" / "version_0")["throughput/tokens_per_sec"])[6] == pytest.approx(
        tokens / seconds, rel=0.03
    )


class VariableBatches(TinyTextDataModule):
    """Batches of 3, 8 and 13 sequences in turn (each padded to its own longest sequence)."""

    def train_dataloader(self):
        loader = super().train_dataloader()
        sizes, batches, start = [3, 8, 13], [], 0
        while start + 13 <= len(self.train_set):
            size = sizes[len(batches) % 3]
            batches.append(list(range(start, start + size)))
            start += size
        return DataLoader(self.train_set, batch_sampler=batches, collate_fn=loader.collate_fn)


def test_variable_batch_sizes_and_lengths_count_for_what_they_are(tmp_path):
    reference, monitor = TokenReference(), ThroughputMonitor(every_n_steps=3)
    fit(tmp_path, [reference, monitor], data=VariableBatches(batch_size=8), max_steps=7)
    scalars = read_scalars(tmp_path / "tb" / "version_0")
    tokens, positions, seconds = reference.window(3, 6)
    samples = reference.sample_counts[6] - reference.sample_counts[3]
    assert samples == 3 + 8 + 13  # steps 4, 5, 6
    assert dict(scalars["throughput/samples_per_sec"])[6] == pytest.approx(samples / seconds, rel=0.03)
    assert dict(scalars["throughput/tokens_per_sec"])[6] == pytest.approx(tokens / seconds, rel=0.03)
    assert dict(scalars["throughput/padding_frac"])[6] == pytest.approx(1 - tokens / positions, abs=1e-6)


def test_slow_dataset_is_data_loading_bound(tmp_path):
    """Bug 19: a sleeping ``__getitem__``."""
    monitor, ranks = ThroughputMonitor(every_n_steps=2, patience=3), PerRankLogger(every_n_steps=2)
    # 400 ms of sleep per batch: most of a step even on a machine so loaded that a step computes for a second
    fit(tmp_path, [monitor, ranks], data=TinyTextDataModule(batch_size=8, slow_getitem_s=0.05), max_steps=9)
    [finding] = [f for f in monitor.findings if f.code == "TFD601"]
    assert finding.severity == "warning" and finding.evidence["dataloader_wait_frac"] > 0.2
    assert "num_workers" in finding.hint
    # the per-rank record of each measured step holds that step's wait: 8 samples x at least 50 ms of sleep
    records = (tmp_path / "tb" / "version_0" / "tfdebug" / "rank0.jsonl").read_text().splitlines()
    waits = [json.loads(line)["dataloader_wait_ms"] for line in records]
    assert len(waits) == 5 and all(w >= 400 for w in waits[1:])
    assert ranks.findings == []  # one process: no cross-rank finding


class PaddedData(TinyTextDataModule):
    """Keeps only the first 24 tokens of every row and pads the rest, as a too-long fixed padding length does."""

    def train_dataloader(self):
        loader = super().train_dataloader()
        collate = loader.collate_fn

        def padded(samples):
            batch = collate(samples)
            batch["input_ids"][:, 24:] = 256
            batch["attention_mask"][:, 24:] = 0
            batch["labels"][:, 24:] = -100
            return batch

        loader.collate_fn = padded
        return loader


def test_padding_waste(tmp_path):
    monitor = ThroughputMonitor(every_n_steps=1, patience=2)
    fit(tmp_path, [monitor], data=PaddedData(batch_size=8), max_steps=3)
    [finding] = [f for f in monitor.findings if f.code == "TFD602"]
    # most computed positions are padding: a warning, with the speed-ups measured from the real counts
    padding = finding.evidence["padding_frac"]
    assert finding.severity == "warning" and padding > 0.5
    assert finding.evidence["speedup_packing"] == pytest.approx(1 / (1 - padding), rel=1e-6)
    # rows are cut to 24 tokens and padded past them: trimming each batch to its longest row alone gains width / 24
    batch = PaddedData(batch_size=8)
    batch.setup("fit")
    width = next(iter(batch.train_dataloader()))["input_ids"].shape[1]
    assert finding.evidence["speedup_trim_to_longest"] == pytest.approx(width / 24, rel=0.2)


def test_padding_span_is_sampled_on_measuring_steps_and_scaled_to_the_window(tmp_path):
    # measuring every 4th step: the span is read on steps 0, 4 and 8 only, and the trim factor is still width / 24
    # (a ratio of positions to trimmed positions of the same micro-batches), while the padding fraction comes from
    # every batch's real-token count
    monitor = ThroughputMonitor(every_n_steps=4, patience=2)
    fit(tmp_path, [monitor], data=PaddedData(batch_size=8), max_steps=9)
    [finding] = [f for f in monitor.findings if f.code == "TFD602"]
    batch = PaddedData(batch_size=8)
    batch.setup("fit")
    width = next(iter(batch.train_dataloader()))["input_ids"].shape[1]
    assert finding.evidence["speedup_trim_to_longest"] == pytest.approx(width / 24, rel=0.2)
    assert monitor._counts.sampled == 0  # the sample starts again with each window


class SlowsDown(TinyGPT):
    """From step 14 every step sleeps 10x the median step time of steps 2-13, as this machine ran them: a slowdown of
    the run's own making, the same multiple on an idle machine and on a loaded one."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.starts: list[float] = []

    def training_step(self, batch, batch_idx):
        step = self.trainer.global_step
        if step < 14:
            self.starts.append(time.perf_counter())
        else:
            early = sorted(b - a for a, b in zip(self.starts[2:], self.starts[3:]))
            time.sleep(max(0.05, 10 * early[len(early) // 2]))
        return super().training_step(batch, batch_idx)


def test_step_time_regressing_against_the_early_window(tmp_path):
    # windows of 4 steps of ~10 ms are noisy on a shared machine (1.66x seen in CI with nothing injected): the test
    # asks for 3x, well above that noise and well below the ~10x injected
    monitor = ThroughputMonitor(
        every_n_steps=2, window=4, skip_steps=2, baseline_steps=8, patience=2, regression_factor=3.0
    )
    fit(tmp_path, [monitor], model=SlowsDown(**SMALL), max_steps=24)
    [finding] = [f for f in monitor.findings if f.code == "TFD603"]
    assert finding.evidence["ratio_to_early"] > 3.0 and finding.step >= 16


FAST_CADENCE = dict(every_n_steps=2, window=4, skip_steps=2, baseline_steps=8, patience=2, regression_factor=2.0)


def loaded_run(tmp_path, **spec) -> list[dict]:
    """The findings of ``tests/scripts/loaded_run.py`` run with ``spec`` in a process of its own."""
    (tmp_path / "spec.json").write_text(json.dumps({"monitor": FAST_CADENCE, "steps": 36, "threads": 1, **spec}))
    script = os.path.join(os.path.dirname(os.path.dirname(__file__)), "scripts", "loaded_run.py")
    done = subprocess.run([sys.executable, script, str(tmp_path / "spec.json")], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-3000:]
    [line] = [line for line in done.stdout.splitlines() if line.startswith("loaded-run: ")]
    return json.loads(line[len("loaded-run: ") :])


@pytest.mark.skipif(not os.path.exists("/proc/self/task"), reason="reads run-queue waits from /proc/self/task")
def test_a_slowdown_from_other_processes_is_not_blamed_on_the_run(tmp_path):
    # from step 14, busy loops keep twice the cores busy and the run drops to nice 5: its share of a core falls at
    # least 3x whatever else loads the machine (weight 335 against 1024 per busy loop), so the slowdown is certain
    findings = loaded_run(tmp_path, at=14, nice=5)
    codes = [f["code"] for f in findings]
    assert "TFD603" not in codes and "TFD605" in codes, findings
    evidence = next(f for f in findings if f["code"] == "TFD605")["evidence"]
    # the same work waited longer for a core: at least half the rise, or 1.5x with no more CPU per step
    assert evidence["contention_ratio"] >= 1.5 and evidence["ratio_to_early"] > 2.0, evidence


_PAUSER = """
import os, signal, sys, time
pid, stop_file = int(sys.argv[1]), sys.argv[2]
try:
    while not os.path.exists(stop_file):
        os.kill(pid, signal.SIGSTOP)
        time.sleep(0.024)
        os.kill(pid, signal.SIGCONT)
        time.sleep(0.008)
finally:
    os.kill(pid, signal.SIGCONT)
"""


class PausedByTheMachine(TinyGPT):
    """From step 14 the process is stopped for 24 ms out of every 32, as a hypervisor that takes the virtual CPU away
    (steal time) does: no run-queue wait, no other process's CPU use, the same CPU time per step, a longer wall."""

    def __init__(self, stop_file: str, **kwargs):
        super().__init__(**kwargs)
        self.stop_file = stop_file
        self.pauser: subprocess.Popen | None = None

    def training_step(self, batch, batch_idx):
        if self.trainer.global_step == 14 and self.pauser is None:
            self.pauser = subprocess.Popen([sys.executable, "-c", _PAUSER, str(os.getpid()), self.stop_file])
        return super().training_step(batch, batch_idx)


@pytest.mark.skipif(not hasattr(signal, "SIGSTOP"), reason="stops the process with SIGSTOP")
def test_a_machine_that_takes_the_cpu_away_is_not_blamed_on_the_run(tmp_path):
    monitor = ThroughputMonitor(
        every_n_steps=2, window=4, skip_steps=2, baseline_steps=8, patience=2, regression_factor=1.5
    )
    stop_file = tmp_path / "stop"
    model = PausedByTheMachine(str(stop_file), **SMALL)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as in the test without /proc: no amplification at parallel regions on a loaded machine
    try:
        fit(tmp_path, [monitor], model=model, max_steps=40)
    finally:
        torch.set_num_threads(threads)
        stop_file.touch()
        if model.pauser is not None:
            model.pauser.wait(timeout=30)
    found = {f.code for f in monitor.findings}
    assert "TFD603" not in found, [(f.code, f.step, str(f.evidence)) for f in monitor.findings]
    [finding] = [f for f in monitor.findings if f.code == "TFD605"]
    # the machine explains it: the reference (steal leaves no run-queue wait) or, on a loaded machine where every
    # continued process waits for a core, the contention ratio too
    evidence = finding.evidence
    machine = max(evidence["reference_ratio"], evidence["contention_ratio"])
    assert machine - 1 >= 0.5 * (evidence["ratio_to_early"] - 1) and finding.step >= 16, evidence


@pytest.fixture
def without_proc(monkeypatch):
    """A machine without ``/proc`` (macOS): run-queue waits cannot be read."""
    import lightning_tfdebug.core.host as host

    monkeypatch.setattr(host, "thread_run_delays", lambda: None)
    monkeypatch.setattr(host, "thread_run_delay_ns", lambda: None)


def test_without_proc_a_loaded_machine_is_told_from_the_run_by_a_fixed_reference_computation(tmp_path):
    # as above on a machine without /proc: the reference computation's wall time slows with the run's share of a core
    findings = loaded_run(tmp_path, at=14, nice=5, without_proc=True)
    codes = [f["code"] for f in findings]
    assert "TFD603" not in codes and "TFD605" in codes, findings
    evidence = next(f for f in findings if f["code"] == "TFD605")["evidence"]
    assert math.isnan(evidence["contention_ratio"]) and evidence["reference_ratio"] >= 1.5, evidence


@pytest.mark.slow
@pytest.mark.parametrize("without_proc", [False, True], ids=["with-proc", "without-proc"])
def test_a_run_whose_work_grows_is_flagged_while_other_processes_keep_twice_the_cores_busy(tmp_path, without_proc):
    # the busy loops run from the start, as on a shared runner: the early window is as loaded as the rest
    findings = loaded_run(tmp_path, at=0, grow=14, without_proc=without_proc, steps=50)
    regressed = [f for f in findings if f["code"] == "TFD603"]
    # other sessions' load is not the test's to hold still: a streak the machine explained must show it measured
    # (its contention ratio up by half the rise per unit of work); the run's growth is then TFD603 once it is not
    explained = [f["evidence"] for f in findings if f["code"] == "TFD605"]
    assert regressed or all(e["contention_ratio"] >= 1.5 for e in explained), findings
    assert regressed or explained, findings


def test_without_proc_a_run_that_slows_itself_is_its_own_slowdown(tmp_path, without_proc):
    monitor = ThroughputMonitor(
        every_n_steps=2, window=4, skip_steps=2, baseline_steps=8, patience=2, regression_factor=3.0
    )
    fit(tmp_path, [monitor], model=SlowsDown(**SMALL), max_steps=24)
    # the steps took many times longer; the reference computation, timed on the slow measuring step, did not. (On a
    # loaded machine without /proc one reading of the reference can be the scheduler's luck: a TFD605 first, then this)
    [finding] = [f for f in monitor.findings if f.code == "TFD603"]
    assert finding.evidence["ratio_to_early"] > 3.0
    assert finding.evidence["reference_ratio"] - 1 < 0.5 * (finding.evidence["ratio_to_early"] - 1)


@pytest.mark.slow
@pytest.mark.ci  # it keeps every core busy for ~13 s, slowing the default run's other worker too: in CI's ci lane
@pytest.mark.skipif(not os.path.exists("/proc/self/task"), reason="reads run-queue waits from /proc/self/task")
def test_a_run_that_slows_itself_on_a_machine_full_of_other_work_is_still_its_own_slowdown(tmp_path):
    # Other processes keep every core busy from the start. When the run sleeps from step 14, they take the cores it
    # leaves, so their CPU use rises as it would under new contention; the run's own wait for a core does not.
    spin = [sys.executable, "-c", "while True: pass"]
    hogs = [subprocess.Popen(spin) for _ in range(min(2 * (os.cpu_count() or 2), 32))]
    try:
        time.sleep(0.5)
        monitor = ThroughputMonitor(
            every_n_steps=2, window=4, skip_steps=2, baseline_steps=8, patience=2, regression_factor=4.0
        )
        fit(tmp_path, [monitor], model=SlowsDown(**SMALL), max_steps=24)
    finally:
        for hog in hogs:
            hog.kill()
            hog.wait()
    found = {f.code for f in monitor.findings}
    assert "TFD603" in found and "TFD605" not in found, [(f.code, f.step, f.evidence) for f in monitor.findings]


@pytest.mark.skipif(not os.path.exists("/proc/self/task"), reason="reads run-queue waits from /proc/self/task")
def test_run_delay_is_this_process_waiting_for_a_core():
    from lightning_tfdebug.core.host import CpuWindow

    def spin(seconds):
        end = time.perf_counter() + seconds
        while time.perf_counter() < end:
            pass

    load = CpuWindow()
    load.start()
    time.sleep(0.3)  # not runnable: no wait for a core, however busy the machine
    load.stop()
    asleep = load.run_delay_s
    code = "import time\nend = time.time() + 1.0\nwhile time.time() < end: pass"
    hogs = [subprocess.Popen([sys.executable, "-c", code]) for _ in range(2 * (os.cpu_count() or 2))]
    try:
        time.sleep(0.2)
        load.start()
        spin(0.5)  # runnable the whole time, sharing the cores with twice as many busy loops
        load.stop()
        crowded = load.run_delay_s
    finally:
        for hog in hogs:
            hog.kill()
            hog.wait()
    assert 0 <= asleep < 0.05 and crowded > 0.1, (asleep, crowded)


def test_memory_close_to_capacity(tmp_path):
    monitor = ThroughputMonitor(every_n_steps=1, memory_threshold=1e-6)  # any process is "close" to this
    fit(tmp_path, [monitor], max_steps=1)
    [finding] = [f for f in monitor.findings if f.code == "TFD604"]
    assert finding.evidence["memory_frac"] > 1e-6


def test_mfu_from_flop_counter_and_a_given_peak(tmp_path):
    monitor = ThroughputMonitor(every_n_steps=4, peak_flops=1e12)
    fit(tmp_path, [monitor], max_steps=9)
    scalars = read_scalars(tmp_path / "tb" / "version_0")
    # independent: FLOPs of one forward+backward on a batch of the same width, per position
    model = TinyGPT(**SMALL)
    batch = next(iter(TinyTextDataModule(batch_size=8).train_dataloader()))
    from torch.utils.flop_counter import FlopCounterMode

    with FlopCounterMode(display=False) as counter:
        model.loss(model(batch["input_ids"], batch["attention_mask"]), batch["labels"]).backward()
    expected = counter.get_total_flops() / batch["input_ids"].numel()
    assert monitor.flops_per_token == pytest.approx(expected, rel=0.15)  # attention cost varies a little with width
    mfu = dict(scalars["throughput/mfu"])
    tps = dict(scalars["throughput/tokens_per_sec_per_device"])
    assert sorted(mfu) == [4, 8]
    assert mfu[8] == pytest.approx(monitor.flops_per_token * tps[8] / 1e12, rel=1e-4)


def test_profile_steps_write_a_trace_and_a_top_operators_table(tmp_path):
    monitor = ThroughputMonitor(every_n_steps=10, profile_steps=[2, 4], profile_row_limit=10)
    trainer = fit(tmp_path, [monitor], max_steps=5)
    out = tmp_path / "tb" / "version_0" / "tfdebug" / "profile"
    trace = json.loads((out / "rank0.pt.trace.json").read_text())
    names = {e.get("name", "") for e in trace["traceEvents"]}
    assert any("aten::" in n for n in names)
    table = (out / "rank0-top_ops.txt").read_text()
    assert "optimizer steps 2 to 3" in table and "Self CPU" in table
    assert trainer.global_step == 5


def test_state_is_saved_and_restored_on_resume(tmp_path):
    first = ThroughputMonitor(every_n_steps=2, skip_steps=1, baseline_steps=3, peak_flops=1e12)
    ckpt = ModelCheckpoint(dirpath=tmp_path / "ckpt", save_last=True)
    fit(tmp_path, [first, ckpt], max_steps=6, enable_checkpointing=True)
    assert len(first._times.baseline) == 3 and first.flops_per_token
    resumed = ThroughputMonitor(every_n_steps=2, skip_steps=1, baseline_steps=3, peak_flops=1e12)
    trainer = make_trainer(tmp_path, [resumed], max_steps=7)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.fit(TinyGPT(**SMALL), TinyTextDataModule(batch_size=8), ckpt_path=str(tmp_path / "ckpt" / "last.ckpt"))
    assert list(resumed._times.baseline.values) == list(first._times.baseline.values)
    assert resumed.flops_per_token == first.flops_per_token
    assert resumed._times.seen == 7


def test_built_from_lightning_cli_yaml(tmp_path):
    from lightning.pytorch.cli import LightningCLI

    config = tmp_path / "config.yaml"
    config.write_text(
        """
trainer:
  callbacks:
    - class_path: lightning_tfdebug.ThroughputMonitor
      init_args:
        every_n_steps: 25
        profile_steps: [10, 12]
        peak_flops: 3.0e+14
        length_fn: tests.callbacks.test_throughput_monitor.count_supervised
        on_finding: stop
    - class_path: lightning_tfdebug.PerRankLogger
      init_args:
        every_n_steps: 10
        straggler_factor: 2.0
"""
    )
    cli = LightningCLI(TinyGPT, TinyTextDataModule, run=False, args=["--config", str(config)])
    [monitor] = [c for c in cli.trainer.callbacks if isinstance(c, ThroughputMonitor)]
    [ranks] = [c for c in cli.trainer.callbacks if isinstance(c, PerRankLogger)]
    assert (monitor.every_n_steps, monitor.profile_steps, monitor.peak_flops) == (25, (10, 12), 3e14)
    assert monitor._length_fn is count_supervised and monitor.on_finding == "stop"
    assert (ranks.every_n_steps, ranks.straggler_factor) == (10, 2.0)


@pytest.mark.ddp
def test_ddp_tokens_per_sec_is_the_sum_over_ranks_and_a_healthy_run_is_silent(tmp_path):
    spec = {
        "strategy": "ddp",
        "model": SMALL,
        "data": {"batch_size": 8},
        "trainer": {"max_steps": 13},
        "callbacks": [
            {"class_path": "tests.callbacks.test_throughput_monitor.TokenReference"},
            {"class_path": "lightning_tfdebug.ThroughputMonitor", "init_args": {"every_n_steps": 6}},
            {"class_path": "lightning_tfdebug.PerRankLogger", "init_args": {"every_n_steps": 2}},
        ],
        "extra": "tests.callbacks.test_throughput_monitor:token_reference_results",
    }
    results = run_distributed(tmp_path, spec)
    for r in results:
        assert r["error"] is None, r["error"]
        assert r["findings"] == {"TokenReference": [], "ThroughputMonitor": [], "PerRankLogger": []}
    logged = dict(read_scalars(tmp_path / "tb" / "version_0")["throughput/tokens_per_sec"])
    assert sorted(logged) == [0, 6, 12]
    tokens = sum(r["extra"]["cumulative"]["12"][0] - r["extra"]["cumulative"]["6"][0] for r in results)
    seconds = max(r["extra"]["ends"]["12"] - r["extra"]["ends"]["6"] for r in results)
    assert logged[12] == pytest.approx(tokens / seconds, rel=0.03)  # both ranks' tokens, not rank 0's x 2
    assert results[0]["metrics"]["throughput/tokens_per_sec_per_device"] == pytest.approx(logged[12] / 2, rel=1e-5)
    # every rank got the same gathered numbers
    assert results[0]["metrics"]["throughput/tokens_per_sec"] == pytest.approx(
        results[1]["metrics"]["throughput/tokens_per_sec"]
    )
    # PerRankLogger: one file per rank, one record per measured step, rank 0 logged both ranks
    log_dir = tmp_path / "tb" / "version_0" / "tfdebug"
    for rank in (0, 1):
        records = [json.loads(line) for line in (log_dir / f"rank{rank}.jsonl").read_text().splitlines()]
        assert [rec["step"] for rec in records] == [0, 2, 4, 6, 8, 10, 12]
        assert all(rec["rank"] == rank and rec["batch_fingerprint"] is not None for rec in records)
    scalars = read_scalars(tmp_path / "tb" / "version_0")
    assert {"per_rank/loss/rank0", "per_rank/loss/rank1", "per_rank/busy_ms/max_over_median"} <= set(scalars)


def batches_of_widths(widths, rows=4):
    batches = []
    for i, width in enumerate(widths):
        ids = (torch.arange(width).repeat(rows, 1) + i) % 250
        batches.append({"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids.clone()})
    return DataLoader(batches, batch_size=None)


class CompiledBlocks(TinyGPT):
    """Blocks compiled with static shapes: every new sequence length is a new graph."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        for i, block in enumerate(self.blocks):
            self.blocks[i] = torch.compile(block, backend="eager", dynamic=False)


def test_torch_compile_recompiling_every_step_is_named(tmp_path):
    monitor = ThroughputMonitor(every_n_steps=2, skip_steps=2, baseline_steps=4, patience=2)
    widths = [16] * 8 + list(range(17, 41))  # fixed during the early window, then a new length every step
    fit(tmp_path, [monitor], model=CompiledBlocks(**SMALL), data=batches_of_widths(widths), max_steps=len(widths))
    [recompiling] = [f for f in monitor.findings if f.code == "TFD606"]
    assert recompiling.evidence["new_graphs"] >= 2 and "TORCH_LOGS" in recompiling.hint
    [gave_up] = [f for f in monitor.findings if f.code == "TFD607"]
    assert gave_up.evidence["limit_hits"] >= 1 and gave_up.step > recompiling.step

    steady = ThroughputMonitor(every_n_steps=2, skip_steps=2, baseline_steps=4, patience=2)
    fit(tmp_path / "steady", [steady], model=CompiledBlocks(**SMALL), data=batches_of_widths([24] * 20), max_steps=20)
    assert not {"TFD606", "TFD607"} & {f.code for f in steady.findings}


@pytest.mark.parametrize("kind", ["dataclass", "encoding"])
def test_dataclass_and_batch_encoding_batches_count_their_real_tokens(tmp_path, kind):
    from tests.callbacks.batch_guard.test_callback import ReadsFields, typed_batches

    monitor = ThroughputMonitor(every_n_steps=3)
    trainer = make_trainer(tmp_path, [monitor], max_steps=4)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.fit(ReadsFields(**SMALL), train_dataloaders=typed_batches(kind))
    real = [6, 8, 7, 9]  # real lengths of the four batches (4 rows of 24 positions each)
    padding = dict(read_scalars(tmp_path / "tb" / "version_0")["throughput/padding_frac"])
    assert padding[0] == pytest.approx(1 - real[0] / 24, abs=1e-6)
    assert padding[3] == pytest.approx(1 - sum(real[1:]) / 72, abs=1e-6)


class SharedView(pl.Callback):
    """Runs after the pack's callbacks: how many readings of this step's batch exist, and was the count shared."""

    def __init__(self):
        self.views, self.counted = [], []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        from lightning_tfdebug.core.step import step_state

        held = step_state(trainer)  # the step's shared state: the batch and its readings
        assert held.batch is batch
        self.views.append(len(held.batch_views))
        self.counted.append(all("tokens" in v._cache for v in held.batch_views.values()))


def test_the_pack_reads_each_batch_once_and_counts_its_tokens_once(tmp_path):
    from lightning_tfdebug import BatchGuard

    probe = SharedView()
    pack = [BatchGuard(), ThroughputMonitor(), PerRankLogger(), probe]
    fit(tmp_path, pack, max_steps=4)
    assert probe.views == [1, 1, 1, 1] and all(probe.counted)


def test_the_reference_computation_is_timed_early_only_and_its_early_speed_is_kept_with_the_state(
    tmp_path, monkeypatch
):
    import lightning_tfdebug.callbacks.throughput_monitor as module

    timed_at: list[int] = []
    real = module.reference_work_ms

    class Counting(ThroughputMonitor):
        def _measure(self, trainer, now):
            before = len(calls)
            super()._measure(trainer, now)
            if len(calls) > before:
                timed_at.append(trainer.global_step)

    calls: list[float] = []
    parallel_calls: list[float] = []

    def timed(parallel=False):
        (parallel_calls if parallel else calls).append(real(parallel=parallel))
        return (parallel_calls if parallel else calls)[-1]

    monkeypatch.setattr(module, "reference_work_ms", timed)
    # a factor no noise reaches: no measurement is slow, so only the early ones time the reference
    monitor = Counting(every_n_steps=2, window=4, skip_steps=2, baseline_steps=8, patience=2, regression_factor=100.0)
    fit(tmp_path, [monitor], max_steps=30)
    # the measuring steps that fill the early window (steps 2-9), then none while no measurement is slow
    assert timed_at and max(timed_at) <= 12 and len(calls) >= 3, timed_at
    state = monitor.state_dict()
    assert len(state["reference_baseline"]["values"]) == len(calls) == len(parallel_calls)  # each beside the other
    assert len(state["parallel_baseline"]["values"]) == len(parallel_calls)
    resumed = ThroughputMonitor(every_n_steps=2, window=4, skip_steps=2, baseline_steps=8, patience=2)
    resumed.load_state_dict(state)
    assert resumed._load.reference_base.median() == monitor._load.reference_base.median() > 0
    assert resumed._load.parallel_base.median() == monitor._load.parallel_base.median() > 0
