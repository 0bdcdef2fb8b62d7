"""AttentionProbe: the entropy of every attention layer on random weights, before the first optimizer step."""

from __future__ import annotations

import contextlib
import inspect
import math
import time
from collections.abc import Iterator, Mapping
from typing import Any, ClassVar

import lightning.pytorch as pl
import torch
from torch import Tensor, nn

from lightning_tfdebug.callbacks.attention_probe.readings import AttentionCapture, LayerReading, find_head_dim, measure
from lightning_tfdebug.core.base import DebugCallback, eager_model_calls, model_is_compiled
from lightning_tfdebug.core.batch import step_batch
from lightning_tfdebug.core.calls import StepRecording, record_step
from lightning_tfdebug.findings import OnFinding
from lightning_tfdebug.functional import attention_checks as checks
from lightning_tfdebug.functional.attention_checks import COVERAGE as COVERAGE_ROWS
from lightning_tfdebug.primitives import call_finder, calls
from lightning_tfdebug.primitives.batch import BatchKeys
from lightning_tfdebug.primitives.keys import Key

_FUSED_SETTING = (
    "an eager attention path for one forward: `attn_implementation='eager'` for Hugging Face models, or a softmax "
    "over the scores in place of `F.scaled_dot_product_attention`"
)


_COMPILED = "the forward is compiled: recording its calls would add module hooks that make torch.compile recompile it"


class AttentionProbe(DebugCallback):
    r"""Measures the entropy of every attention layer at step 0, on random weights, and flags a broken attention scale.

    At the first training batch of a fit that starts at step 0, AttentionProbe records the model call
    ``training_step`` makes, and before the first optimizer step replays that call once (eval mode, ``no_grad``, RNG
    forked) catching every attention softmax: a hand-written ``softmax`` over ``(B, H, T, S)`` scores, the softmax
    inside ``nn.MultiheadAttention`` (forced to return its weights for the replay), else a Hugging Face model's
    ``output_attentions=True``. Each layer's mean entropy is compared with the entropy its own mask (causal, padding)
    gives with uniform scores, and the content spread of its scores is measured. Attention far sharper than uniform
    is ``TFD240``, naming the layer and the scale it implies (1/sqrt(d) missing, or ``* sqrt(d)``). Fused attention
    (``F.scaled_dot_product_attention``, flash) cannot be read: recorded as a check aside. Other steps cost nothing.
    Codes and thresholds: ``docs/callbacks/attention_probe.md``; the logged keys: :attr:`KEYS`.

    Args:
        on_finding: ``"warn"``, ``"stop"`` or ``"raise"``.
        input_key: where the token ids are in the batch; ``None`` finds them.
        mask_key: where the attention mask is; ``None`` finds it.
        labels_key: where the labels are; ``None`` finds them.

    Example:
        ```python
        trainer = Trainer(callbacks=[AttentionProbe()])
        ```

        LightningCLI:

        ```yaml
        trainer:
          callbacks:
            - class_path: lightning_tfdebug.AttentionProbe
              init_args:
                on_finding: warn
        ```
    """

    COVERAGE: ClassVar[Mapping[str, tuple[str, ...]]] = COVERAGE_ROWS  # declared beside the rules

    KEYS: ClassVar[tuple[Key, ...]] = checks.KEYS

    def __init__(
        self,
        on_finding: OnFinding = "warn",
        input_key: str | int | None = None,
        mask_key: str | int | None = None,
        labels_key: str | int | None = None,
    ) -> None:
        super().__init__(on_finding=on_finding)
        self.input_key, self.mask_key, self.labels_key = input_key, mask_key, labels_key
        self._keys = BatchKeys(input_key=input_key, mask_key=mask_key, labels_key=labels_key)
        self._recording: StepRecording | None = None
        self._batch: Any = None
        self._done = False
        self._prediction: tuple[Tensor, int] | None = None
        self.layers: list[checks.LayerEntropy] = []
        self.last_report: dict[str, float] = {}

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        super().setup(trainer, pl_module, stage)
        self._done, self.layers = False, []
        strategy = type(trainer.strategy).__name__
        if any(name in strategy for name in ("FSDP", "ModelParallel", "DeepSpeed")):
            self.stand_aside(
                f"the {strategy} strategy shards parameters, so a replay of the model call is a collective. Run "
                "AttentionProbe in a single-device or DDP run of the model."
            )

    # ------------------------------------------------------------------ hooks
    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        if self._done or not self.active or trainer.sanity_checking:
            return  # every step after the first: nothing at all
        self._done = True
        if trainer.global_step != 0:
            self.check_aside("attention at init", "the fit resumed after step 0: the weights are trained")
            return
        if model_is_compiled(trainer, pl_module):  # module hooks on compiled code would make Dynamo recompile it
            self.check_aside(
                "attention at init", _COMPILED, "run the preflight (`tfdebug check`) without torch.compile"
            )
            return
        self._batch = batch
        self._recording = record_step(trainer, pl_module, batch, self, calls.takes_tokens)

    def on_before_backward(self, trainer: pl.Trainer, pl_module: pl.LightningModule, loss: Any) -> None:
        self._probe(trainer, pl_module)  # the forward is over; the weights are still those of init

    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        self._probe(trainer, pl_module)  # no backward ran through Lightning (a manual step without manual_backward)

    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        if self._recording is not None:
            self._recording.done(self)
        self._recording, self._batch = None, None

    # ------------------------------------------------------------------ the probe
    def _probe(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self._recording is None:
            return
        recording, batch = self._recording, self._batch
        self._recording, self._batch = None, None
        try:
            recorded = recording.calls()
        finally:
            recording.done(self)  # the model call found below holds what it needs
        start = time.perf_counter()
        fields = step_batch(trainer, batch, self._keys).fields
        ids = fields.input_ids
        if not isinstance(ids, Tensor) or ids.ndim != 2 or ids.is_floating_point():
            self.stand_aside("no 2-D token ids found in the batch", setting="`input_key`")
            return
        mask = (
            fields.attention_mask
            if fields.attention_mask is not None and fields.attention_mask.shape == ids.shape
            else None
        )
        labels = fields.labels if fields.labels is not None and fields.labels.shape == ids.shape else None
        found = call_finder.find_model_call(recorded, ids, mask, labels, self._keys.ignore_index, pl_module)
        del recorded
        if isinstance(found, str):
            self.stand_aside(found, setting="`input_key` (where the token ids are)")
            return
        try:
            readings, fused = self._replay(pl_module, found)
        except Exception as err:  # never crash training: say why and stand aside
            self.stand_aside(f"replaying the model call failed ({type(err).__name__}: {err})")
            return
        finally:
            found.release()
        if fused and not readings:
            where = ", ".join(sorted(set(fused))[:3])
            self.check_aside(
                "attention at init",
                f"attention is fused (in {where}): its probabilities are never formed, so they cannot be read",
                setting=_FUSED_SETTING,
            )
            return
        if not readings:
            self.check_aside(
                "attention at init", "no attention softmax ran in the model's forward", setting=_FUSED_SETTING
            )
            return
        if fused:
            self.check_aside(
                "attention at init, fused layers",
                f"{len(set(fused))} layer(s) use fused attention and were not read",
                setting=_FUSED_SETTING,
            )
        self._conclude(trainer, readings, time.perf_counter() - start)

    def _conclude(self, trainer: pl.Trainer, readings: list[LayerReading], seconds: float) -> None:
        fields: dict[str, Any] = {}
        if self._prediction is not None:
            fields["prediction_entropy"] = self._prediction[0]
        for i, r in enumerate(readings):
            for name in ("entropy", "uniform", "spread", "keys"):
                value = getattr(r, name)
                if value is not None:
                    fields[f"{i}.{name}"] = value
        host = self.to_host(fields)  # host sync: one transfer, at step 0 only
        self.layers = [
            checks.LayerEntropy(
                r.layer,
                host[f"{i}.entropy"],
                host[f"{i}.uniform"],
                host.get(f"{i}.spread"),
                host[f"{i}.keys"],
                r.head_dim,
            )
            for i, r in enumerate(readings)
        ]
        spreads = [layer.spread for layer in self.layers if layer.spread is not None]
        lowest = min(self.layers, key=lambda layer: layer.ratio)
        report = {
            "attention/entropy_min": min(layer.entropy for layer in self.layers),
            "attention/uniform": lowest.uniform,
            "attention/entropy_ratio_min": lowest.ratio,
            "attention/layers": float(len(self.layers)),
            "attention/seconds": seconds,
        }
        if spreads:
            report["attention/spread_max"] = max(spreads)
        self.last_report = report
        self.log_scalars(trainer, report)
        vocab = self._prediction[1] if self._prediction is not None else 0
        if not checks.is_fresh(host.get("prediction_entropy"), vocab):
            self.check_aside(
                "attention at init",
                f"the weights are trained, not random: the step-0 predictions have "
                f"an entropy of {host['prediction_entropy']:.2f} nats against ln(V) = {math.log(vocab):.2f}",
            )
        else:
            self.emit(trainer, checks.decide(self.layers), synchronized=False)
            self.cover("attention at init", "verified")
        self.resolve_local_findings(trainer)  # every rank probes at step 0, so every rank resolves here

    def _replay(self, pl_module: pl.LightningModule, found: calls.ModelCall) -> tuple[list[LayerReading], list[str]]:
        """One replay of the model call catching every attention softmax; then ``output_attentions`` if none ran."""
        root = found.call.module
        modes = {m: m.training for m in pl_module.modules()}
        device = next((t.device for _, t in found.call.leaves()), torch.device("cpu"))
        try:
            with (
                eager_model_calls(),
                torch.random.fork_rng(devices=[device.index or 0] if device.type == "cuda" else []),
                torch.no_grad(),
                _tracking(root) as (where, inside_mha),
            ):
                pl_module.eval()
                capture = AttentionCapture(where, found.batch_size, inside_mha)
                with capture:
                    output = found.call.call()
                self._prediction = _prediction_entropy(calls.read_logits(output, found.batch_size, found.out_seq_first))
                del output
                if capture.readings or not _takes_output_attentions(root):
                    return capture.readings, capture.fused
                again = AttentionCapture(where, found.batch_size, inside_mha)
                with again:
                    out = root(*found.call.args, **{**found.call.kwargs, "output_attentions": True})
                if again.readings:
                    return again.readings, []
                return _output_attentions(out, root), capture.fused
        finally:
            for module, flag in modes.items():
                module.training = flag


def _prediction_entropy(logits: Tensor | None) -> tuple[Tensor, int] | None:
    """The mean entropy of the predictions over the vocabulary (a device scalar) and V, on at most 4096 positions."""
    if logits is None or logits.shape[-1] < 2:
        return None
    rows = logits.detach().reshape(-1, logits.shape[-1])[:4096].float()
    return -(rows.softmax(-1) * rows.log_softmax(-1)).sum(-1).mean(), int(logits.shape[-1])


def _takes_output_attentions(module: nn.Module) -> bool:
    try:
        parameters = inspect.signature(module.forward).parameters
    except (TypeError, ValueError):
        return False
    return "output_attentions" in parameters or any(p.kind is p.VAR_KEYWORD for p in parameters.values())


def _output_attentions(out: Any, root: nn.Module) -> list[LayerReading]:
    """The readings of a Hugging Face output's attention probabilities (``attentions``, ``decoder_attentions``...)."""
    readings = []
    head_dim = find_head_dim(getattr(root, "config", None))
    for field in ("attentions", "encoder_attentions", "decoder_attentions", "cross_attentions"):
        for i, probs in enumerate(getattr(out, field, None) or ()):
            if isinstance(probs, Tensor) and probs.ndim == 4:
                readings.append(measure(f"{field}[{i}]", probs, None, head_dim))
    return readings


@contextlib.contextmanager
def _tracking(root: nn.Module) -> Iterator[tuple[Any, Any]]:
    """Hooks for one replay: which module runs now (for the layer's name), and ``nn.MultiheadAttention`` asked for its
    per-head weights (its fast path off), so its softmax runs in Python where the capture sees it."""
    stack: list[tuple[str, nn.Module]] = [("", root)]
    handles = []

    def enter(name: str) -> Any:
        return lambda module, args: stack.append((name, module))

    def leave(module: nn.Module, args: Any, output: Any) -> None:
        if len(stack) > 1:
            stack.pop()

    def weights(module: nn.Module, args: Any, kwargs: dict) -> tuple[Any, dict]:
        return args, {**kwargs, "need_weights": True, "average_attn_weights": False}

    for name, module in root.named_modules():
        if name:
            handles.append(module.register_forward_pre_hook(enter(name)))
            handles.append(module.register_forward_hook(leave, always_call=True))
        if isinstance(module, nn.MultiheadAttention):
            handles.append(module.register_forward_pre_hook(weights, with_kwargs=True))
    fastpath = torch.backends.mha.get_fastpath_enabled()
    torch.backends.mha.set_fastpath_enabled(False)  # the fused encoder layer would skip the attention's own forward
    try:
        yield (lambda: stack[-1]), (lambda: any(isinstance(m, nn.MultiheadAttention) for _, m in stack))
    finally:
        torch.backends.mha.set_fastpath_enabled(fastpath)
        for handle in handles:
            handle.remove()
