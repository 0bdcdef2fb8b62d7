"""The whole pack at its defaults on models this project did not shape around its detectors.

Each callback is tested alone next to its code; here all of them run together, as a user who adds the pack to an
existing run would, on healthy models (the bundled TinyGPT, Hugging Face GPT-2, Llama in bf16 with accumulation,
a BERT masked LM and a T5 encoder-decoder built from tiny configs, and a causal LM on `torch.nn.TransformerEncoder`
fed tuple batches), and must stay silent: no warning and no error. Then bugs are injected into the foreign models and
the pack must name them.
"""

from __future__ import annotations

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import lightning_tfdebug as tfd
from lightning_tfdebug.demo import ByteTokenizer, TinyGPT
from lightning_tfdebug.rules import RULES
from tests.healthy_models import periodic_text
from tests.helpers import SMALL, fit_tiny

try:
    import transformers
except ImportError:  # pragma: no cover - transformers is a test dependency
    transformers = None

VOCAB = ByteTokenizer.vocab_size


def the_pack() -> list[pl.Callback]:
    return [
        tfd.GradNormMonitor(),
        tfd.UpdateRatio(),
        tfd.NaNFirstFrame(),
        tfd.ScalerWatch(),
        tfd.DeadActivation(),
        tfd.LossAtInit(check_step=40),
        tfd.ThroughputMonitor(),
        tfd.PerRankLogger(),
        tfd.BatchGuard(),
        tfd.ReproCapture(),
        tfd.MaskProbe(),
        tfd.OptimizerAudit(),
        tfd.CheckpointAudit(),
        tfd.StallWatchdog(),
    ]


def problems(callbacks) -> list[str]:
    """Every warning or error the pack raised, as ``"CODE Source: message"``."""
    return [
        f"{f.code} {f.source}: {f.message}"
        for c in callbacks
        for f in getattr(c, "findings", [])
        if f.severity in ("warning", "error")
    ]


def codes(callbacks) -> set[str]:
    return {f.code for c in callbacks for f in getattr(c, "findings", []) if f.severity != "info"}


def adamw_with_warmup(module: nn.Module, lr: float) -> dict:
    """What a careful user configures: AdamW, no decay on norms, biases and embeddings, a 10-step linear warm-up."""
    named = [(n, p) for n, p in module.named_parameters() if p.requires_grad]
    decay = [p for n, p in named if p.ndim >= 2 and "emb" not in n and "wte" not in n and "wpe" not in n]
    rest = [p for n, p in named if not (p.ndim >= 2 and "emb" not in n and "wte" not in n and "wpe" not in n)]
    optimizer = torch.optim.AdamW(
        [{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0}], lr=lr
    )
    warmup = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / 10))
    return {"optimizer": optimizer, "lr_scheduler": {"scheduler": warmup, "interval": "step"}}


# ---------------------------------------------------------------- a causal LM on nn.TransformerEncoder, tuple batches
class EncoderLM(pl.LightningModule):
    """``batch = (tokens, targets)``, targets already shifted by the data; no attention mask (fixed-length rows)."""

    def __init__(self, causal: bool = True, dead_bias: float = 0.0, context: int = 32, lr: float = 2e-3):
        super().__init__()
        self.causal, self.context, self.lr = causal, context, lr
        self.embed = nn.Embedding(VOCAB, 32)
        self.pos = nn.Parameter(torch.zeros(context, 32))
        layer = nn.TransformerEncoderLayer(32, 2, 64, dropout=0.0, activation="relu", batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
        self.out = nn.Linear(32, VOCAB)
        if dead_bias:
            for block in self.encoder.layers:
                nn.init.constant_(block.linear1.bias, dead_bias)  # every pre-ReLU value negative: dead units

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        t = tokens.shape[1]
        if t > self.context:
            raise IndexError(f"sequence of {t} tokens is longer than the position table ({self.context})")
        mask = nn.Transformer.generate_square_subsequent_mask(t) if self.causal else None
        h = self.embed(tokens) + self.pos[:t]
        return self.out(self.encoder(h, mask=mask, is_causal=self.causal))

    def training_step(self, batch, batch_idx):
        tokens, targets = batch
        logits = self(tokens)
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))
        self.log("loss", loss)
        return loss

    def configure_optimizers(self):
        return adamw_with_warmup(self, self.lr)


def tuple_loader(batch_size: int = 16) -> DataLoader:
    text = periodic_text()
    return DataLoader(TensorDataset(text[:, :-1], text[:, 1:]), batch_size=batch_size, shuffle=True)


# ---------------------------------------------------------------- a Hugging Face GPT-2, dict batches with labels
class HFLM(pl.LightningModule):
    def __init__(self):
        super().__init__()
        config = transformers.GPT2Config(
            n_layer=2, n_embd=32, n_head=2, vocab_size=VOCAB, n_positions=64, attn_implementation="eager"
        )
        self.model = transformers.GPT2LMHeadModel(config)

    def forward(self, input_ids, attention_mask=None, labels=None):
        return self.model(input_ids=input_ids, attention_mask=attention_mask, labels=labels)

    def training_step(self, batch, batch_idx):
        loss = self(**batch).loss  # Hugging Face shifts the labels inside the model
        self.log("loss", loss)
        return loss

    def configure_optimizers(self):
        return adamw_with_warmup(self, 2e-3)


needs_transformers = pytest.mark.skipif(transformers is None, reason="needs `transformers`")


def fit_pack(tmp_path, model, data, steps: int = 60, **kwargs):
    pack = the_pack()
    fit_tiny(tmp_path, pack, model, data, max_steps=steps, log_every_n_steps=10, **kwargs)
    for finding in (f for c in pack for f in c.findings):  # every finding of every run is a registered rule's
        assert RULES[finding.code].source == finding.source, finding.format()
    return pack


# ---------------------------------------------------------------- healthy: silent
def test_the_pack_is_silent_on_the_healthy_tiny_transformer(tmp_path):
    pack = fit_pack(tmp_path, TinyGPT(**SMALL), None)
    assert problems(pack) == []


def test_the_pack_is_silent_on_a_healthy_encoder_lm_with_tuple_batches(tmp_path):
    pack = fit_pack(tmp_path, EncoderLM(), tuple_loader())
    assert problems(pack) == []
    loss_at_init = next(c for c in pack if isinstance(c, tfd.LossAtInit))
    assert loss_at_init.findings == [] or all(f.severity == "info" for f in loss_at_init.findings)


@needs_transformers
def test_the_pack_is_silent_on_a_healthy_hugging_face_gpt2(tmp_path):
    from lightning_tfdebug.demo import TinyTextDataModule

    pack = fit_pack(tmp_path, HFLM(), TinyTextDataModule(batch_size=8))
    assert problems(pack) == []


# ---------------------------------------------------------------- bugs in models the detectors were not written for
def test_a_missing_causal_mask_in_a_torch_encoder_lm_is_named(tmp_path):
    pack = fit_pack(tmp_path, EncoderLM(causal=False), tuple_loader(), steps=2)
    assert "TFD201" in codes(pack)


def test_dead_relu_units_in_a_torch_encoder_lm_are_named(tmp_path):
    pack = fit_pack(tmp_path, EncoderLM(dead_bias=-20.0), tuple_loader(), steps=20)
    assert "TFD340" in codes(pack) or "TFD341" in codes(pack), problems(pack)


def test_softmax_before_the_loss_in_a_torch_encoder_lm_is_named(tmp_path):
    class SoftmaxLM(EncoderLM):
        def forward(self, tokens):
            return super().forward(tokens).softmax(-1)

    pack = fit_pack(tmp_path, SoftmaxLM(), tuple_loader(), steps=2)
    assert "TFD220" in codes(pack), problems(pack)


def test_labels_not_shifted_for_a_torch_encoder_lm_are_named(tmp_path):
    text = periodic_text()
    unshifted = DataLoader(TensorDataset(text[:, :-1], text[:, :-1]), batch_size=16, shuffle=True)
    pack = fit_pack(tmp_path, EncoderLM(), unshifted, steps=45)
    assert codes(pack) & {"TFD205", "TFD226"}, problems(pack)


def test_sequence_past_the_position_table_of_a_torch_encoder_lm_is_caught_before_the_forward(tmp_path):
    text = periodic_text(length=33)
    long = periodic_text(rows=16, length=49)
    batches = DataLoader([(t[:, :-1], t[:, 1:]) for t in (text[:16], text[16:32], long)], batch_size=None)
    guard = tfd.BatchGuard(on_finding="raise")
    with pytest.raises(tfd.TFDebugError, match="sequence length 48"):
        fit_tiny(tmp_path, [guard], EncoderLM(), batches, max_steps=3)
    [finding] = [f for f in guard.findings if f.severity == "error"]
    assert finding.step == 2 and finding.evidence["max_length"] == 32, finding


@needs_transformers
def test_a_gpt2_head_left_out_of_the_optimizer_is_named(tmp_path):
    from lightning_tfdebug.demo import TinyTextDataModule

    class Frozen(HFLM):
        def configure_optimizers(self):
            body = [p for n, p in self.named_parameters() if not n.startswith("model.transformer.h.1.")]
            return torch.optim.AdamW(body, lr=2e-3, weight_decay=0.0)

    pack = fit_pack(tmp_path, Frozen(), TinyTextDataModule(batch_size=8), steps=20)
    assert "TFD320" in codes(pack) or "TFD312" in codes(pack), problems(pack)


@needs_transformers
def test_a_learning_rate_100x_too_high_behind_a_warmup_on_gpt2_is_named(tmp_path):
    from lightning_tfdebug.demo import TinyTextDataModule

    class TooHot(HFLM):
        def configure_optimizers(self):
            return adamw_with_warmup(self, 0.2)  # 100x the healthy 2e-3, still warmed up over 10 steps

    pack = fit_pack(tmp_path, TooHot(), TinyTextDataModule(batch_size=8), steps=31)
    assert "TFD313" in codes(pack), problems(pack)


def test_a_learning_rate_100x_too_high_on_a_torch_encoder_lm_is_named(tmp_path):
    pack = fit_pack(tmp_path, EncoderLM(lr=0.2), tuple_loader(), steps=31)
    assert "TFD313" in codes(pack), problems(pack)


# ---------------------------------------------------------------- an encoder: a Hugging Face BERT masked LM
MASK_ID = VOCAB - 1


class BertMLM(pl.LightningModule):
    def __init__(self):
        super().__init__()
        config = transformers.BertConfig(
            vocab_size=VOCAB,
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=2,
            max_position_embeddings=64,
        )
        self.model = transformers.BertForMaskedLM(config)

    def forward(self, input_ids, attention_mask=None, labels=None):
        return self.model(input_ids=input_ids, attention_mask=attention_mask, labels=labels)

    def training_step(self, batch, batch_idx):
        loss = self(**batch).loss
        self.log("loss", loss)
        return loss

    def configure_optimizers(self):
        return adamw_with_warmup(self, 2e-3)


def mlm_collate(rows: list[torch.Tensor]) -> dict[str, torch.Tensor]:
    """BERT's recipe: 15% of positions supervised, 80% of those replaced by the mask token in the input."""
    ids = torch.stack(rows)
    draw = torch.rand(ids.shape)
    labels = torch.where(draw < 0.15, ids, torch.full_like(ids, -100))
    inputs = torch.where(draw < 0.12, torch.full_like(ids, MASK_ID), ids)
    return {"input_ids": inputs, "attention_mask": torch.ones_like(ids), "labels": labels}


@needs_transformers
def test_the_pack_is_silent_on_a_healthy_bert_masked_lm(tmp_path):
    # A bidirectional encoder is not a decoder without its causal mask: MaskProbe reads the objective from the labels.
    data = DataLoader(list(periodic_text(length=32)), batch_size=16, shuffle=True, collate_fn=mlm_collate)
    pack = fit_pack(tmp_path, BertMLM(), data)
    assert problems(pack) == []
    probe = next(c for c in pack if isinstance(c, tfd.MaskProbe))
    # The labels ride in the model call: the leak probe perturbs them (an MLM's logits must not read them) while the
    # masked inputs, unrelated to the labels, are never perturbed as if they were a decoder's future.
    assert probe.last_report["mask_probe/causal_max_change"] == 0.0
    assert "mask_probe/padding_max_change" in probe.last_report


# ---------------------------------------------------------------- more architectures: Llama (bf16, accumulation), T5
class LlamaLM(HFLM):
    def __init__(self):
        pl.LightningModule.__init__(self)
        config = transformers.LlamaConfig(
            vocab_size=VOCAB,
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=64,
        )
        self.model = transformers.LlamaForCausalLM(config)


@needs_transformers
def test_the_pack_is_silent_on_a_healthy_llama_in_bf16_with_accumulation(tmp_path):
    from lightning_tfdebug.demo import TinyTextDataModule

    pack = fit_pack(
        tmp_path, LlamaLM(), TinyTextDataModule(batch_size=8), precision="bf16-mixed", accumulate_grad_batches=2
    )
    assert problems(pack) == []


class T5LM(HFLM):
    def __init__(self):
        pl.LightningModule.__init__(self)
        config = transformers.T5Config(
            vocab_size=VOCAB, d_model=32, d_kv=16, d_ff=64, num_layers=2, num_heads=2, decoder_start_token_id=0
        )
        self.model = transformers.T5ForConditionalGeneration(config)


def seq2seq_collate(rows: list[torch.Tensor]) -> dict[str, torch.Tensor]:
    """The first half of each row is the source, the second half the target."""
    ids = torch.stack(rows)
    source, target = ids[:, :16].contiguous(), ids[:, 16:32].contiguous()
    return {"input_ids": source, "attention_mask": torch.ones_like(source), "labels": target}


@needs_transformers
def test_the_pack_is_silent_on_a_healthy_t5_encoder_decoder(tmp_path):
    data = DataLoader(list(periodic_text(length=32)), batch_size=16, shuffle=True, collate_fn=seq2seq_collate)
    pack = fit_pack(tmp_path, T5LM(), data)
    assert problems(pack) == []
    probe = next(c for c in pack if isinstance(c, tfd.MaskProbe))
    # the decoder side is probed through the labels passed in the call (T5 shifts them right itself)
    assert probe.last_report["mask_probe/causal_max_change"] == 0.0
    assert "TFD212" not in {f.code for f in probe.findings}


def test_a_summed_loss_in_a_torch_encoder_lm_is_named_as_such(tmp_path):
    class SummedLM(EncoderLM):
        def training_step(self, batch, batch_idx):
            tokens, targets = batch
            logits = self(tokens)
            return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1), reduction="sum")

    pack = fit_pack(tmp_path, SummedLM(), tuple_loader(), steps=2)
    assert "TFD229" in codes(pack) and "TFD222" not in codes(pack), problems(pack)


def test_manual_optimization_that_never_zeroes_gradients_is_named(tmp_path):
    class NoZeroGrad(EncoderLM):
        def __init__(self):
            super().__init__()
            self.automatic_optimization = False

        def training_step(self, batch, batch_idx):
            tokens, targets = batch
            logits = self(tokens)
            self.manual_backward(F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1)))
            self.optimizers().step()  # no zero_grad: gradients pile up
            self.lr_schedulers().step()

    pack = fit_pack(tmp_path, NoZeroGrad(), tuple_loader(), steps=12)
    assert "TFD334" in codes(pack), problems(pack)


@needs_transformers
def test_a_learning_rate_100x_too_low_on_gpt2_is_not_taken_for_copying(tmp_path):
    # GPT-2 ties its input and output embeddings: untrained, it already predicts its current token at most positions.
    # Barely trained (lr 2e-5), it still does; that is no sign of unshifted labels.
    from lightning_tfdebug.demo import TinyTextDataModule

    class TooCold(HFLM):
        def configure_optimizers(self):
            return adamw_with_warmup(self, 2e-5)

    pack = fit_pack(tmp_path, TooCold(), TinyTextDataModule(batch_size=8), steps=45)
    assert "TFD310" in codes(pack) and "TFD226" not in codes(pack), problems(pack)
    loss_at_init = next(c for c in pack if isinstance(c, tfd.LossAtInit))
    assert loss_at_init._run.init_copy_rate > 0.3  # the tied embeddings' copying at init, measured


@needs_transformers
def test_unshifted_labels_on_gpt2_are_named_despite_tied_embeddings(tmp_path):
    from lightning_tfdebug.demo import TinyTextDataModule

    class Unshifted(HFLM):
        def training_step(self, batch, batch_idx):
            logits = self(batch["input_ids"], batch["attention_mask"]).logits
            return F.cross_entropy(logits.flatten(0, 1), batch["labels"].flatten(), ignore_index=-100)

    pack = fit_pack(tmp_path, Unshifted(), TinyTextDataModule(batch_size=8), steps=45)
    assert {"TFD205", "TFD226"} <= codes(pack), problems(pack)


@needs_transformers
def test_labels_shifted_by_hand_and_again_inside_gpt2_are_named(tmp_path):
    from lightning_tfdebug.demo import TinyTextDataModule

    class ShiftsTwice(HFLM):
        def training_step(self, batch, batch_idx):
            labels = torch.full_like(batch["labels"], -100)
            labels[:, :-1] = batch["labels"][:, 1:]  # shifted here, and again inside GPT2LMHeadModel
            return self(batch["input_ids"], batch["attention_mask"], labels).loss

    pack = fit_pack(tmp_path, ShiftsTwice(), TinyTextDataModule(batch_size=8), steps=2)
    assert "TFD206" in codes(pack), problems(pack)
    probe = next(c for c in pack if isinstance(c, tfd.MaskProbe))
    [finding] = [f for f in probe.findings if f.code == "TFD206"]
    assert finding.evidence["labels_relation"] == "inputs"
    assert finding.evidence["loss_returned"] == pytest.approx(finding.evidence["loss_shifted2"], rel=1e-4)


# ---------------------------------------------------------------------------------------------------- per-step dispatch
class _HookLog(pl.Callback):
    """Notes, per optimizer step, which batch hooks of the pack's members ran (instance-level wrappers)."""

    def __init__(self, pack: tfd.TFDebug) -> None:
        self.pack = pack
        self.step = -1
        self.calls: dict[int, set[str]] = {}

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        from lightning_tfdebug.core.base import BATCH_HOOKS
        from lightning_tfdebug.pack import _overridden

        for name, member in self.pack.running.items():
            for hook in BATCH_HOOKS:
                if _overridden(member, hook):
                    setattr(member, hook, self._wrap(f"{name}.{hook}", getattr(member, hook)))

    def _wrap(self, label: str, method):
        def wrapped(*args, **kwargs):
            if label.endswith("on_train_batch_start"):
                self.step = args[0].global_step
            self.calls.setdefault(self.step, set()).add(label)
            return method(*args, **kwargs)

        return wrapped


def test_the_pack_calls_a_member_s_batch_hooks_only_on_the_steps_it_works(tmp_path):
    """Issue 25: on a step that does not measure, only the members with per-batch work run (NaNFirstFrame's check,
    ThroughputMonitor's clock and token count, BatchGuard's and ReproCapture's per-batch reading, UpdateRatio's loss
    sum, PerRankLogger's data wait); the measuring members run on measuring steps, LossAtInit also on its own
    compared and check steps, OptimizerAudit also at an epoch's first batch (its train-mode check) and the batch
    after a measuring step (its comparison). What they find is unchanged: the healthy run stays silent and every
    measuring member logged on its measuring steps."""
    pack = tfd.TFDebug(preset="always", every_n_steps=5, overrides={"LossAtInit": {"check_step": 16}})
    log = _HookLog(pack)
    fit_tiny(tmp_path, [pack, log], max_steps=20)
    idle = {"GradNormMonitor", "DeadActivation", "LossAtInit", "ScalerWatch", "OptimizerAudit"}
    compare = set(pack.members["LossAtInit"]._compare_steps())
    for step, ran in log.calls.items():
        members = {label.split(".")[0] for label in ran}
        assert {"NaNFirstFrame", "ThroughputMonitor", "BatchGuard", "ReproCapture", "UpdateRatio"} <= members, step
        if step % 5 == 0:
            assert "GradNormMonitor.on_before_optimizer_step" in ran and "DeadActivation.on_train_batch_start" in ran
            assert "UpdateRatio.on_before_optimizer_step" in ran and "PerRankLogger.on_train_batch_end" in ran
        elif step in compare or step == 16:
            assert members & idle - {"OptimizerAudit"} == {"LossAtInit"}, (step, sorted(ran))
        else:
            assert not members & idle, (step, sorted(ran))  # nothing to do: not called at all
            assert "UpdateRatio.on_before_optimizer_step" not in ran and "PerRankLogger.on_train_batch_end" not in ran
    assert [f.code for f in pack.findings if f.severity in ("warning", "error")] == []
    assert all(m.failure is None for m in pack.running.values())
    assert pack.members["LossAtInit"]._run.check_done  # its check step ran although the cadence skips step 16


def test_a_scheduler_stepped_twice_per_step_is_named_when_the_pack_reads_it_only_on_measuring_steps(tmp_path):
    """OptimizerAudit reads the scheduler's cadence where the pack calls it (measuring steps): 2n calls over n steps."""

    class SteppedTwice(TinyGPT):
        def training_step(self, batch, batch_idx):
            self.lr_schedulers().step()  # by hand, and Lightning steps it again (interval: step)
            return super().training_step(batch, batch_idx)

    pack = tfd.TFDebug(preset="always", every_n_steps=5)
    log = _HookLog(pack)
    fit_tiny(tmp_path, [pack, log], model=SteppedTwice(**SMALL), max_steps=12)
    [finding] = [f for f in pack.findings if f.code == "TFD329"]
    assert finding.step == 5 and finding.evidence["calls"] == 10 and finding.evidence["optimizer_steps"] == 5
    assert "10 times over 5 optimizer steps" in finding.message
    # MaskProbe replayed that training_step once at step 0 (to record the model call): the schedule it stepped by
    # hand there was put back, so the run's own schedule is not changed by the pack
    assert pack.members["MaskProbe"].failure is None and "MaskProbe" in pack.running
    audit_steps = sorted(s for s, ran in log.calls.items() if any(r.startswith("OptimizerAudit.") for r in ran))
    assert 3 not in audit_steps and 7 not in audit_steps  # not called between measuring steps


class _StepAtStart(pl.Callback):
    """Notes the optimizer step a batch trains (``global_step`` at its start; its end sees the next one)."""

    def __init__(self) -> None:
        self.step = -1

    def on_train_batch_start(self, trainer, *args) -> None:
        self.step = trainer.global_step


def _spying(cls: type, ran: dict[int, set[str]], clock: _StepAtStart) -> type:
    """A subclass of ``cls`` whose batch hooks note, per optimizer step, that their body ran (the guard wraps the
    subclass's methods as it wraps every callback's, so a skipped hook leaves no note)."""
    from lightning_tfdebug.core.base import BATCH_HOOKS

    def make(hook: str):
        def method(self, trainer, *args, **kwargs):
            ran.setdefault(clock.step, set()).add(f"{cls.__name__}.{hook}")
            return getattr(super(spy, self), hook)(trainer, *args, **kwargs)

        method.__name__ = hook
        return method

    spy = type(f"Spy{cls.__name__}", (cls,), {h: make(h) for h in BATCH_HOOKS if h in vars(cls)})
    return spy


def test_a_callback_on_its_own_skips_the_batch_hooks_it_has_no_work_for(tmp_path):
    """Issue 25, outside the pack: the guard asks a lone callback's ``busy_at`` at each batch's start and does not run
    its other batch hooks on a step without work, except its ``every_batch_hooks``; measuring steps run them all, and
    what the callbacks log and find is unchanged (each logged on every measuring step, nothing to report)."""
    ran: dict[int, set[str]] = {}
    classes = (tfd.GradNormMonitor, tfd.UpdateRatio, tfd.DeadActivation, tfd.OptimizerAudit, tfd.PerRankLogger)
    clock = _StepAtStart()
    callbacks = [_spying(cls, ran, clock)(every_n_steps=5) for cls in classes]
    trainer = fit_tiny(tmp_path, [clock, *callbacks], max_steps=12)
    for step in range(12):
        names = ran.get(step, set())
        if step % 5 == 0:
            assert {
                "GradNormMonitor.on_before_optimizer_step",
                "UpdateRatio.on_before_optimizer_step",
                "DeadActivation.on_train_batch_start",
                "OptimizerAudit.on_before_optimizer_step",
                "PerRankLogger.on_train_batch_end",
            } <= names, (step, sorted(names))
        else:
            # the per-batch bookkeeping still runs; nothing else of these five
            assert "UpdateRatio.on_train_batch_end" in names and "PerRankLogger.on_train_batch_start" in names
            assert not {n for n in names if n.startswith(("GradNormMonitor", "DeadActivation"))}, (step, names)
            assert (
                "UpdateRatio.on_before_optimizer_step" not in names and "PerRankLogger.on_train_batch_end" not in names
            )
    logged = trainer.callback_metrics
    assert any(k.startswith("grad_norm/") for k in logged) and any(k.startswith("update_ratio/") for k in logged)
    assert any(k.startswith("dead_activation/") for k in logged)
    for callback in callbacks:
        assert callback.failure is None
        assert [f.code for f in callback.findings if f.severity in ("warning", "error")] == []


def test_a_lone_callback_s_dispatch_can_be_turned_off_and_then_runs_every_hook(tmp_path):
    """The switch the pack has (``_per_step_dispatch``) works on a lone callback too: every batch hook runs."""
    ran: dict[int, set[str]] = {}
    clock = _StepAtStart()
    monitor = _spying(tfd.GradNormMonitor, ran, clock)(every_n_steps=5)
    monitor._per_step_dispatch = False
    fit_tiny(tmp_path, [clock, monitor], max_steps=4)
    assert all("GradNormMonitor.on_before_optimizer_step" in ran[step] for step in range(4))


def test_a_lone_callback_under_manual_optimization_runs_every_batch_hook(tmp_path):
    """Under manual optimization one batch may step the optimizer several times, so nothing is skipped there: a lone
    callback's batch hooks run on every batch, as the pack's members' do."""

    class Manual(TinyGPT):
        def __init__(self):
            super().__init__(**SMALL)
            self.automatic_optimization = False

        def training_step(self, batch, batch_idx):
            optimizer = self.optimizers()
            optimizer.zero_grad()
            loss = super().training_step(batch, batch_idx)
            self.manual_backward(loss)
            optimizer.step()
            return loss

    ran: dict[int, set[str]] = {}
    clock = _StepAtStart()
    monitor = _spying(tfd.GradNormMonitor, ran, clock)(every_n_steps=5)
    fit_tiny(tmp_path, [clock, monitor], model=Manual(), max_steps=4)
    assert monitor._manual_optimization and monitor.failure is None
    assert all("GradNormMonitor.on_before_optimizer_step" in ran[step] for step in range(4)), ran
