"""PerRankLogger: every rank's own numbers, in its own file and side by side on the loggers, and where they differ."""

from __future__ import annotations

import json
import math
import os
import time
from collections.abc import Mapping
from typing import Any, ClassVar

import lightning.pytorch as pl
import torch
from torch import Tensor
from torch.nn.modules.batchnorm import _NormBase

from lightning_tfdebug.core.base import DebugCallback, check_number
from lightning_tfdebug.core.batch import step_batch
from lightning_tfdebug.core.distributed import plan_sharding, world_size
from lightning_tfdebug.core.groups import training_model
from lightning_tfdebug.core.host import peak_rss_bytes
from lightning_tfdebug.core.io import append_line, make_dirs
from lightning_tfdebug.core.reduction import Reduced, row_fields
from lightning_tfdebug.core.timing import FetchTimer, StepClock, fetch_timer
from lightning_tfdebug.findings import OnFinding
from lightning_tfdebug.functional import rank_checks
from lightning_tfdebug.functional.batches import batch_fingerprint, combine_fingerprints
from lightning_tfdebug.functional.rank_checks import (
    CHECKSUM_RTOL,
    RankDiagnosis,
    RankRow,
    agreement_sums,
    disagreeing_tensors,
    per_rank_metrics,
)
from lightning_tfdebug.functional.rank_checks import COVERAGE as COVERAGE_ROWS
from lightning_tfdebug.functional.throughput import parameter_checksums
from lightning_tfdebug.primitives.batch import IGNORE_INDEX, BatchKeys, is_id_tensor, loss_of
from lightning_tfdebug.primitives.keys import Key
from lightning_tfdebug.primitives.tensors import DTensor, clean_param_name, local_tensor

_GIB = float(2**30)


class PerRankLogger(DebugCallback):
    r"""Records every rank's loss, timing, memory, batch fingerprint and parameter checksum, and compares the ranks.

    On a measuring step every rank appends one JSON line to its own ``<log_dir>/tfdebug/rank<r>.jsonl`` (loss, step
    and busy time, data wait, peak memory, batch fingerprint, parameter checksum) and declares its
    :class:`~lightning_tfdebug.functional.rank_checks.RankRow` into the step's one reduction over ranks, so every rank
    sees every rank's numbers and reaches the same findings; rank 0 logs them per rank and as spreads (:attr:`KEYS`).
    Other steps: host arithmetic only (no tensor work, no sync, no collective). Details in
    ``docs/callbacks/per_rank_logger.md``.

    Findings: ``TFD501`` identical batches on different ranks, ``TFD502`` parameters differ between replicas,
    ``TFD503`` straggler rank, ``TFD504`` one rank's loss far from the others, ``TFD505`` non-finite loss (the only
    one checked in a single process).

    Args:
        every_n_steps: measure when ``global_step % every_n_steps == 0``; default: the Trainer's
            ``log_every_n_steps``.
        on_finding: ``"warn"``, ``"stop"`` or ``"raise"`` (see :class:`~lightning_tfdebug.DebugCallback`).
        log_per_rank: log one key per rank and statistic (``False``: only the spreads; the files still hold all).
        straggler_factor: ``TFD503`` when a rank's busy time plus data wait exceeds this multiple of the median of
            the other ranks ...
        straggler_min_ms: ... and exceeds it by at least this many milliseconds ...
        loss_spread: ``TFD504`` when a rank's loss differs from the median over ranks by more than this fraction of
            it (two ranks: of the smaller loss) ...
        patience: ... for this many measurements in a row (also ``TFD501``'s identical batches).
        compare_parameters: compare per-tensor checksums of parameters and buffers (not norm layers' running
            statistics) across replicas (``TFD502``); skipped under sharded strategies and in a single process.
        input_key: where the batch's token ids are (:mod:`lightning_tfdebug.core.batch`); ``None`` finds them by
            their usual names or, in a tuple batch, by position.
        mask_key: where the attention mask (1 = real token) is; given and found as ``input_key``.
        labels_key: where the labels are; given and found as ``input_key``.
        ignore_index: the label value the loss ignores; ``None`` is PyTorch's and Hugging Face's -100.

    Raises:
        ValueError: on an argument outside its allowed range.

    Example:
        ```python
        trainer = Trainer(strategy="ddp", devices=8, callbacks=[PerRankLogger(every_n_steps=50)])
        ```

        With LightningCLI:

        ```yaml
        trainer:
          callbacks:
            - class_path: lightning_tfdebug.PerRankLogger
              init_args:
                every_n_steps: 50
        ```
    """

    COVERAGE: ClassVar[Mapping[str, tuple[str, ...]]] = COVERAGE_ROWS  # declared beside the rules
    COVERAGE_WATCHED: ClassVar[frozenset[str]] = frozenset(COVERAGE)  # verified by watching the whole fit

    KEYS: ClassVar[tuple[Key, ...]] = rank_checks.KEYS  # what `per_rank_metrics` computes, declared beside it

    def __init__(
        self,
        every_n_steps: int | None = None,
        on_finding: OnFinding = "warn",
        log_per_rank: bool = True,
        straggler_factor: float = 1.5,
        straggler_min_ms: float = 10.0,
        loss_spread: float = 0.5,
        patience: int = 3,
        compare_parameters: bool = True,
        input_key: str | int | None = None,
        mask_key: str | int | None = None,
        labels_key: str | int | None = None,
        ignore_index: int | None = None,
    ) -> None:
        super().__init__(every_n_steps=every_n_steps, on_finding=on_finding)
        check_number("ignore_index", ignore_index, integer=True, optional=True)
        # raises a TypeError naming the argument when a key is not a string, a tuple position or None
        self._batch_keys = BatchKeys(
            input_key, mask_key, labels_key, ignore_index=IGNORE_INDEX if ignore_index is None else ignore_index
        )
        self.input_key, self.mask_key, self.labels_key = input_key, mask_key, labels_key
        self.ignore_index = self._batch_keys.ignore_index
        check_number("straggler_factor", straggler_factor, low=1.0, low_inclusive=False)
        check_number("straggler_min_ms", straggler_min_ms, low=0.0)
        check_number("loss_spread", loss_spread, low=0.0, low_inclusive=False)
        check_number("patience", patience, low=1, integer=True)
        for flag, value in (("log_per_rank", log_per_rank), ("compare_parameters", compare_parameters)):
            if not isinstance(value, bool):
                raise TypeError(f"`{flag}` must be True or False; got {value!r}.")
        self.log_per_rank = log_per_rank
        self.straggler_factor = float(straggler_factor)
        self.straggler_min_ms = float(straggler_min_ms)
        self.loss_spread = float(loss_spread)
        self.patience = patience
        self.compare_parameters = compare_parameters
        self._diagnosis = RankDiagnosis(self.straggler_factor, self.straggler_min_ms, self.loss_spread, patience)
        self._reset()

    @property
    def state_key(self) -> str:
        return self._generate_state_key(every_n_steps=self.every_n_steps)

    def _reset(self) -> None:
        self._clock: StepClock | None = None
        self._timer: FetchTimer | None = None
        self._fetch_seen = 0.0
        self._step_at_start = -1
        self._measuring = False
        self._marks: list[list[Any]] = []  # per micro-batch: [start, before_backward, after_backward, end]
        self._losses: list[Tensor] = []
        self._fingerprint: Tensor | None = None
        self._wait_s = 0.0
        self._params: list[Tensor] | None = None
        self._param_names: list[str] = []
        self._checksum_skip_reason: str | None = None

    @property
    def rank_file(self) -> str:
        """``<log_dir>/tfdebug/rank<r>.jsonl``: this rank's records."""
        return os.path.join(self.tfdebug_dir, f"rank{self._rank}.jsonl")

    # ------------------------------------------------------------------ set-up
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        super().setup(trainer, pl_module, stage)  # caches log_dir (a collective under DDP) once, on every rank
        self._reset()
        if trainer.world_size == 1:
            self.cover("ranks agree", "n/a", "one process: there are no other ranks to compare.")
        make_dirs(self.tfdebug_dir)  # False (warned once) if the disk refuses; records then stay off disk

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._clock = StepClock(trainer.strategy.root_device)

    def _prepare_parameters(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """Once, after the strategy has wrapped the model: the tensors to checksum, and whether to compare them."""
        model = training_model(trainer, pl_module)
        named = [(clean_param_name(n), p) for n, p in model.named_parameters()]
        # Buffers too (bug 17 can hit a step counter or a cache), except running statistics of normalization layers
        # (BatchNorm, InstanceNorm): each replica updates those from its own batch, so they differ by design.
        local_stats = {id(b) for m in model.modules() if isinstance(m, _NormBase) for b in m.buffers(recurse=False)}
        named += [(clean_param_name(n), b) for n, b in model.named_buffers() if id(b) not in local_stats]
        self._param_names = [n for n, _ in named]
        self._params = [p for _, p in named]
        strategy = type(trainer.strategy).__name__
        if not self.compare_parameters:
            self._checksum_skip_reason = "compare_parameters=False"
        elif any(isinstance(p, DTensor) for p in self._params) or plan_sharding(self._params, root=model).sharded:
            self._checksum_skip_reason = "parameters are sharded (each rank holds a different shard by design)"
        elif any(s in strategy for s in ("FSDP", "DeepSpeed", "ModelParallel")):
            self._checksum_skip_reason = f"{strategy} shards parameters by design"

    #: every batch's start reads the data loader's wait (host arithmetic): the measuring step's wait is its own
    every_batch_hooks = frozenset({"on_train_batch_start"})

    def busy_at(self, step: int) -> bool:
        """Marks and the measurement on measuring steps only."""
        return step % self._interval == 0 or self._measuring

    # ------------------------------------------------------------------ hooks (other steps: host arithmetic only)
    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        if not self.active or self._clock is None:
            return
        timer = fetch_timer(trainer)
        step = trainer.global_step
        if step != self._step_at_start:  # first micro-batch of an optimizer step
            self._step_at_start = step
            self._measuring = self.should_measure(trainer)
            if timer is not None:
                self._wait_s = timer.total_s - self._fetch_seen if self._timer is timer else 0.0
            self._timer = timer
        elif timer is not None and self._timer is timer:
            self._wait_s += timer.total_s - self._fetch_seen
        if timer is not None:
            self._fetch_seen = timer.total_s
        if not self._measuring:
            return
        self._marks.append([self._clock.mark(), None, None, None])
        ids = step_batch(trainer, batch, self._batch_keys).input_ids  # the step's shared reading of the batch
        if ids is not None and is_id_tensor(ids):  # device work only on measuring steps
            self._fingerprint = combine_fingerprints(self._fingerprint, batch_fingerprint(ids))

    def on_before_backward(self, trainer: pl.Trainer, pl_module: pl.LightningModule, loss: Tensor) -> None:
        if self._measuring and self._marks and self._clock is not None:
            self._marks[-1][1] = self._clock.mark()

    def on_after_backward(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self._measuring and self._marks and self._clock is not None:
            self._marks[-1][2] = self._clock.mark()

    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if not self.active or not self._measuring or not self._marks or self._clock is None:
            return
        self._marks[-1][3] = self._clock.mark()
        loss = loss_of(outputs)
        if loss is not None:
            self._losses.append(loss.detach().float().reshape(-1).mean())
        if trainer.global_step != self._step_at_start:  # the optimizer stepped: the measured step is complete
            if self._params is None:
                self._prepare_parameters(trainer, pl_module)
            with torch.no_grad():
                self._measure(trainer, self._step_at_start)
            self._measuring = False

    # ------------------------------------------------------------------ measuring
    def declares_at(self, step: int, stepped: bool) -> bool:
        """It declares its row at the end of every measuring step's last batch (cadence from ``global_step``)."""
        return stepped and step % self._interval == 0

    def _timings(self) -> tuple[float, float]:
        clock = self._clock
        assert clock is not None
        clock.wait(self._marks[-1][3])  # CUDA: one sync on the last event; then every interval can be read
        step_ms = busy_ms = 0.0
        for start, before_bw, after_bw, end in self._marks:
            total = clock.elapsed_ms(start, end)
            step_ms += total
            if before_bw is not None and after_bw is not None:
                busy_ms += clock.elapsed_ms(start, before_bw) + clock.elapsed_ms(after_bw, end)
            else:
                busy_ms += total
        self._marks = []
        return step_ms, busy_ms

    def _measure(self, trainer: pl.Trainer, step: int) -> None:
        device = trainer.strategy.root_device
        step_ms, busy_ms = self._timings()
        if device.type == "cuda":
            peak = torch.cuda.max_memory_allocated(device)  # allocator bookkeeping, no device sync
        else:
            peak = peak_rss_bytes()
        losses, self._losses = self._losses, []
        loss = torch.stack(losses).mean() if losses else None  # on the device, no sync
        fingerprint, self._fingerprint = self._fingerprint, None
        # one process: no replica to compare with; the checksums are still taken for the file's `param_checksum`
        compare = self._checksum_skip_reason is None and self._params is not None and world_size() > 1
        local = [local_tensor(p) for p in self._params or []]  # DTensor shards: this rank's part, no collective
        checksums = parameter_checksums(local).to(device)  # [norms..., sums...] of parameters and buffers
        weights = torch.arange(1, checksums.numel() + 1, device=device, dtype=torch.float64)
        row = {
            "loss": loss if loss is not None else math.nan,
            "has_loss": 1.0 if loss is not None else 0.0,
            "step_time_ms": step_ms,
            "busy_ms": busy_ms,
            "dataloader_wait_ms": self._wait_s * 1e3,
            "peak_memory_gib": peak / _GIB,
            "fingerprint": fingerprint if fingerprint is not None else -1.0,
            "checksum": (checksums * weights).sum(),
        }
        # Per-tensor agreement over the replicas as sums (8 per checksum, not under sharding) and this rank's row:
        # declared into the step's one reduction over ranks (collective), every rank, same steps, same lengths.
        agreement = agreement_sums(checksums, CHECKSUM_RTOL) if compare else None
        self.reduce_then(
            trainer,
            lambda reduced: self._conclude(trainer, reduced, compare, step),
            device,
            sums={"agreement": agreement} if agreement is not None else None,
            rows=row_fields(RankRow, row),  # in the order RankRow declares, the same on every rank
        )

    def _conclude(self, trainer: pl.Trainer, reduced: Reduced, compare: bool, step: int) -> None:
        host = reduced.host()  # host sync: the one transfer of this measuring step (rows and agreement sums together)
        world = host.world_size
        stats = [RankRow(**r) for r in host.per_rank()]
        mine = stats[trainer.global_rank] if trainer.global_rank < len(stats) else stats[0]
        self._write_record(trainer, step, mine)
        self.log_scalars(trainer, per_rank_metrics(stats, self.log_per_rank), step=step)
        # every value comes from the reduction: every rank takes the same decisions (synchronized findings)
        differing = disagreeing_tensors(host.sums["agreement"], world, self._param_names) if compare else None
        self.emit(trainer, self._diagnosis.update(stats, step, differing=differing))

    def _write_record(self, trainer: pl.Trainer, step: int, mine: RankRow) -> None:
        record = {
            "step": step,
            "rank": trainer.global_rank,
            "time": time.time(),
            "loss": mine.loss if mine.has_loss else None,
            "step_time_ms": mine.step_time_ms,
            "busy_ms": mine.busy_ms,
            "dataloader_wait_ms": mine.dataloader_wait_ms,
            "peak_memory_gib": mine.peak_memory_gib,
            "batch_fingerprint": int(mine.fingerprint) if mine.fingerprint >= 0 else None,
            "param_checksum": mine.checksum,
        }
        append_line(self.rank_file, json.dumps(record, allow_nan=True), sync=False)  # never raises on a full disk

    # ------------------------------------------------------------------ state
    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self._timer = None  # it wraps the fit loop's data fetcher: no reference to the Trainer outlives the fit

    def state_dict(self) -> dict[str, Any]:
        return {**super().state_dict(), "streaks": self._diagnosis.state_dict()}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        super().load_state_dict(state_dict)
        self._diagnosis.load_state_dict(state_dict.get("streaks", {}))
