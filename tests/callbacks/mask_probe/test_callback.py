import warnings

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F
from lightning.pytorch.callbacks import Callback

from lightning_tfdebug import MaskProbe, TFDebugError, TFDebugWarning
from lightning_tfdebug.demo import TinyGPT, TinyTextDataModule
from tests.bug_models import dict_data
from tests.callbacks.torch_calls import TorchCalls
from tests.helpers import (
    SMALL,
    BatchEncodingGPT,
    DataclassBatchGPT,
    fit_tiny,
    make_trainer,
    read_scalars,
    run_distributed,
)


def fit(tmp_path, callbacks, model=None, data=None, **kwargs):
    kwargs.setdefault("max_steps", 2)
    return fit_tiny(tmp_path, callbacks, model, data, **kwargs)


def problems(callback):
    """Codes of the warning and error findings (info findings such as the context limit are not problems)."""
    return sorted({f.code for f in callback.findings if f.severity != "info"})


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"probe_rows": 0}, "probe_rows"),
        ({"probe_length": 2}, "probe_length"),
        ({"padding_side": "middle"}, "padding_side"),
        ({"causal": "yes"}, "causal"),
        ({"context_limit": 0}, "context_limit"),
        ({"forward_fn": ""}, "forward_fn"),
        ({"input_key": ""}, "input_key"),
        ({"every_n_steps": 0}, "every_n_steps"),
        ({"model_kind": "seq2seq"}, "model_kind"),
    ],
)
def test_bad_arguments_fail_at_construction(kwargs, match):
    with pytest.raises((ValueError, TypeError), match=match):
        MaskProbe(**kwargs)


class ModeSpy(Callback):
    """Records every submodule's mode right after MaskProbe (which runs first in the list) probed."""

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if batch_idx == 0:
            self.training = {name: m.training for name, m in pl_module.named_modules()}


def test_healthy_tiny_transformer_raises_nothing_and_restores_modes(tmp_path):
    model = TinyGPT(**SMALL)
    probe, spy = MaskProbe(), ModeSpy()

    class FreezeOneNorm(Callback):  # a deliberately eval-mode submodule must stay in eval mode
        def on_train_start(self, trainer, pl_module):
            pl_module.ln_f.eval()

    trainer = fit(tmp_path, [FreezeOneNorm(), probe, spy], model=model)
    assert problems(probe) == []
    assert spy.training.pop("ln_f") is False
    assert all(spy.training.values())
    report = probe.last_report
    assert report["mask_probe/causal_max_change"] == 0.0
    assert report["mask_probe/repeat_max_change"] == 0.0
    assert report["mask_probe/padding_max_change"] == 0.0
    assert report["mask_probe/pad_side_max_change"] == 0.0
    assert report["mask_probe/loss_returned"] == pytest.approx(report["mask_probe/loss_shifted"], rel=1e-5)
    assert [f.code for f in probe.findings] == ["TFD208"]  # the context limit, as information
    assert "64 tokens" in probe.findings[0].message
    scalars = read_scalars(tmp_path / "tb" / "version_0")
    assert "mask_probe/causal_max_change" in scalars and "mask_probe/seconds" in scalars
    assert trainer.global_step == 2


def test_probe_leaves_the_rng_stream_untouched(tmp_path):
    seen = []

    class Draw(Callback):
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            if batch_idx == 0:
                seen.append(torch.rand(3))

    torch.manual_seed(0)
    fit(tmp_path / "a", [Draw()], max_steps=1)
    torch.manual_seed(0)
    fit(tmp_path / "b", [MaskProbe(), Draw()], max_steps=1)
    assert torch.equal(seen[0], seen[1])


@pytest.mark.parametrize("flag, code", [("no_causal_mask", "TFD201"), ("unshifted_labels", "TFD205")])
def test_bug_zoo_rows_7_9(tmp_path, flag, code):
    probe = MaskProbe()
    fit(tmp_path, [probe], model=TinyGPT(**SMALL, **{flag: True}))
    assert problems(probe) == [code]
    finding = next(f for f in probe.findings if f.code == code)
    assert finding.severity == "error"
    if code == "TFD201":  # names the largest change and where it happened
        assert finding.evidence["position"] <= finding.evidence["cut"]
        assert finding.evidence["max_change"] > finding.evidence["tolerance"]


class MaskBlindGPT(TinyGPT):
    """A forward that takes no attention mask at all, trained on padded batches."""

    def forward(self, input_ids):
        return super().forward(input_ids, None)

    def training_step(self, batch, batch_idx):
        loss = self.loss(self(batch["input_ids"]), batch["labels"])
        self.log("train/loss", loss)
        return loss


@pytest.mark.parametrize("left", [False, True])
@pytest.mark.parametrize(
    "model, code", [(MaskBlindGPT, "TFD204"), (lambda **kw: TinyGPT(no_padding_mask=True, **kw), "TFD202")]
)
def test_a_mask_ignored_is_an_error_only_where_the_batches_put_padding_before_real_tokens(tmp_path, model, code, left):
    """Right padding of a causal model: real tokens never read the padding after them, so the finding is information
    that says so; left padding: the real tokens read it, an error."""
    probe = MaskProbe()
    fit(tmp_path, [probe], model=model(**SMALL), data=dict_data(collator="left_pad") if left else None, max_steps=1)
    finding = next(f for f in probe.findings if f.code == code)
    assert finding.severity == ("error" if left else "info")
    assert (
        "Harmless for this run's batches (they pad on the right and attention is causal)" in finding.message
    ) != left


def test_left_padding_on_a_model_whose_positions_ignore_the_mask(tmp_path):
    # TinyGPT numbers positions 0..T-1 whatever the mask says: padding added on the left shifts every real token's
    # position, so its logits move with the amount of padding (it only supports right padding)
    probe = MaskProbe(padding_side="left")
    fit(tmp_path, [probe], max_steps=1)
    assert problems(probe) == ["TFD203"]
    finding = next(f for f in probe.findings if f.code == "TFD203")
    assert finding.evidence["side"] == "left" and finding.evidence["max_change"] > finding.evidence["tolerance"]
    assert probe.last_report["mask_probe/padding_max_change"] == 0.0  # the mask itself works


def test_unshifted_labels_under_bf16_true_are_decided_once_the_model_has_learned(tmp_path):
    # a bf16 loss is too coarse to tell the two alignments apart on a fresh model: the probe retries at the fixed
    # steps 1, 5, 20, 50 and decides when the copy task has made the unshifted loss clearly lower
    probe = MaskProbe()
    fit(tmp_path, [probe], model=TinyGPT(**SMALL, unshifted_labels=True), precision="bf16-true", max_steps=51)
    [finding] = [f for f in probe.findings if f.code == "TFD205"]
    assert finding.step > 0 and finding.evidence["loss_unshifted"] < finding.evidence["loss_shifted"]
    assert probe._alignment_decided


class AlwaysDropout(torch.nn.Module):
    def forward(self, x):
        return F.dropout(x, 0.1)  # `training` defaults to True: dropout also in eval mode


@pytest.mark.parametrize("also_no_causal_mask", [False, True])
def test_a_forward_that_is_random_in_eval_mode_is_named_instead_of_blamed_on_the_masks(tmp_path, also_no_causal_mask):
    model = TinyGPT(**SMALL, no_causal_mask=also_no_causal_mask)
    model.ln_f = torch.nn.Sequential(model.ln_f, AlwaysDropout())
    probe = MaskProbe()
    fit(tmp_path, [probe], model=model)
    assert problems(probe) == ["TFD213"]  # not TFD201/202/203: those comparisons would only measure the noise
    [finding] = [f for f in probe.findings if f.code == "TFD213"]
    assert (finding.severity, finding.step) == ("error", 0)
    assert finding.evidence["max_change"] > finding.evidence["tolerance"] > 0
    assert "F.dropout" in finding.hint
    assert probe._alignment_decided  # no retries that would only measure the noise again


def test_encoder_mode_skips_causality(tmp_path):
    probe = MaskProbe(causal=False)
    fit(tmp_path, [probe], model=TinyGPT(**SMALL, no_causal_mask=True))
    assert problems(probe) == []
    assert "mask_probe/causal_max_change" not in probe.last_report


def test_raise_stops_the_run_at_fit_start(tmp_path):
    trainer = make_trainer(tmp_path, [MaskProbe(on_finding="raise")], max_steps=3)
    with warnings.catch_warnings(), pytest.raises(TFDebugError, match="TFD201"):
        warnings.simplefilter("ignore", TFDebugWarning)
        trainer.fit(TinyGPT(**SMALL, no_causal_mask=True), TinyTextDataModule(batch_size=8))
    assert trainer.global_step == 0


def test_labels_shifted_twice(tmp_path):
    class DoubleShiftData(TinyTextDataModule):
        def train_dataloader(self):
            loader = super().train_dataloader()
            collate = loader.collate_fn

            def shifted(samples):
                batch = collate(samples)
                labels = torch.full_like(batch["labels"], -100)
                labels[:, :-1] = batch["labels"][:, 1:]
                return {**batch, "labels": labels}

            return torch.utils.data.DataLoader(loader.dataset, batch_size=8, collate_fn=shifted)

    probe = MaskProbe()
    trainer = make_trainer(tmp_path, [probe], max_steps=1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", TFDebugWarning)
        trainer.fit(TinyGPT(**SMALL), DoubleShiftData(batch_size=8))
    assert problems(probe) == ["TFD206"]
    # the same pre-shifted data with a loss that does not shift again is correct
    probe = MaskProbe()
    trainer = make_trainer(tmp_path / "ok", [probe], max_steps=1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", TFDebugWarning)
        trainer.fit(TinyGPT(**SMALL, unshifted_labels=True), DoubleShiftData(batch_size=8))
    assert problems(probe) == []


class LabelSmoothingGPT(TinyGPT):
    """The next-token loss with label smoothing: correctly shifted, but not the plain cross-entropy of the logits."""

    def __init__(self, smoothing=0.1, **kwargs):
        super().__init__(**kwargs)
        self.smoothing = smoothing

    def loss(self, logits, labels):
        return F.cross_entropy(
            logits[:, :-1].flatten(0, 1), labels[:, 1:].flatten(), ignore_index=-100, label_smoothing=self.smoothing
        )


class ZLossGPT(TinyGPT):
    """The next-token loss plus an auxiliary z-loss on the log-partition function (as PaLM adds)."""

    def loss(self, logits, labels):
        return super().loss(logits, labels) + 1e-4 * logits.logsumexp(-1).square().mean()


@pytest.mark.parametrize(
    "model_class, kwargs, undetermined",
    [(LabelSmoothingGPT, {}, True), (ZLossGPT, {}, True), (LabelSmoothingGPT, {"smoothing": 0.0}, False)],
    ids=["label-smoothing", "aux-z-loss", "no-smoothing"],
)
def test_loss_matching_neither_alignment_is_information(tmp_path, model_class, kwargs, undetermined):
    probe = MaskProbe()
    trainer = fit(tmp_path, [probe], model=model_class(**SMALL, **kwargs))
    assert problems(probe) == []  # the labels are shifted correctly: nothing to fix
    assert probe._alignment_decided  # decided at the first step, not tried again at the retry steps
    assert trainer.global_step == 2
    found = [f for f in probe.findings if f.code == "TFD210"]
    if not undetermined:  # without smoothing the returned loss is the shifted cross-entropy: alignment "next"
        assert found == []
        return
    [finding] = found
    assert (finding.severity, finding.step) == ("info", 0) and "matches neither" in finding.message
    returned, shifted, unshifted = (finding.evidence[k] for k in ("loss_returned", "loss_shifted", "loss_unshifted"))
    assert returned == probe.last_report["mask_probe/loss_returned"]
    # the two alignments are told apart on this batch, and the returned loss is clearly neither (tolerance 2e-5)
    assert abs(shifted - unshifted) > 1e-3
    assert min(abs(returned - shifted), abs(returned - unshifted)) > 1e-4 * returned


class GradientPenaltyGPT(TinyGPT):
    """A ``training_step`` that differentiates its own loss (a gradient-norm penalty): it could never run under
    ``no_grad``. It is never replayed: the probes replay the model call it made."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.steps = 0

    def training_step(self, batch, batch_idx):
        self.steps += 1
        loss = super().training_step(batch, batch_idx)
        (grad,) = torch.autograd.grad(loss, self.head.weight, create_graph=True)
        return loss + 1e-3 * grad.square().sum()


def test_a_step_with_its_own_autograd_is_probed_through_its_real_call(tmp_path):
    probe = MaskProbe()
    model = GradientPenaltyGPT(**SMALL)
    trainer = fit(tmp_path, [probe], model=model)
    assert model.steps == trainer.global_step == 2  # once per batch: the probes replay the model, never the step
    assert problems(probe) == [] and probe.active
    assert probe.last_report["mask_probe/causal_max_change"] == 0.0  # the causal probe ran on the recorded call
    # the returned loss carries the penalty, so it is read and matches neither alignment (never "not checked")
    assert "mask_probe/loss_returned" in probe.last_report
    assert not any("not checked" in f.message for f in probe.findings)


class SkipsTheFirstBatch(TinyGPT):
    """A ``training_step`` that returns None (Lightning skips the batch) for batch 0."""

    def training_step(self, batch, batch_idx):
        return None if batch_idx == 0 else super().training_step(batch, batch_idx)


@pytest.mark.parametrize(
    "model_class, says",
    [
        pytest.param(
            SkipsTheFirstBatch,
            "`training_step` did not return a scalar loss",
            marks=pytest.mark.filterwarnings("ignore:`training_step` returned `None`"),
        ),
    ],
)
def test_training_step_without_a_loss_is_information(tmp_path, model_class, says):
    probe = MaskProbe()
    trainer = fit(tmp_path, [probe], model=model_class(**SMALL))
    assert problems(probe) == []
    [finding] = [f for f in probe.findings if f.code == "TFD210"]
    assert (finding.severity, finding.step) == ("info", 0)
    assert finding.message == f"Target alignment not checked: {says}."
    assert finding.evidence == {}  # no losses to show
    assert "mask_probe/loss_returned" not in probe.last_report
    # only the alignment check stood aside: the other probes ran, and it is not retried
    assert probe.active and probe._alignment_decided
    assert probe.last_report["mask_probe/causal_max_change"] == 0.0
    assert trainer.global_step == 2


def test_model_failing_within_its_stated_context_limit(tmp_path):
    probe = MaskProbe(context_limit=96)  # TinyGPT's position table holds 64
    fit(tmp_path, [probe])
    assert "TFD207" in problems(probe)
    assert "96" in next(f for f in probe.findings if f.code == "TFD207").message


def full_prefix_decode(pl_module, input_ids):
    """A reference incremental decoder: position t sees exactly tokens 0..t."""
    return torch.cat([pl_module(input_ids[:, : t + 1])[:, -1:] for t in range(input_ids.shape[1])], dim=1)


def off_by_one_decode(pl_module, input_ids):
    """A cache bug: the step for position t is run with the prefix shifted by one position."""
    out = [pl_module(input_ids[:, :1])[:, -1:]]
    for t in range(1, input_ids.shape[1]):
        out.append(pl_module(input_ids[:, 1 : t + 1])[:, -1:])
    return torch.cat(out, dim=1)


@pytest.mark.parametrize("fn, codes", [("full_prefix_decode", []), ("off_by_one_decode", ["TFD209"])])
def test_kv_cache_fn(tmp_path, fn, codes):
    probe = MaskProbe(kv_cache_fn=f"tests.callbacks.mask_probe.test_callback:{fn}", probe_length=16)
    fit(tmp_path, [probe], max_steps=1)
    assert problems(probe) == codes


class DictForwardGPT(TinyGPT):
    """A model whose forward takes the whole batch dict: MaskProbe cannot guess how to call it."""

    def forward(self, batch):
        return super().forward(batch["input_ids"], batch.get("attention_mask"))

    def training_step(self, batch, batch_idx):
        loss = self.loss(self(batch), batch["labels"])
        self.log("train/loss", loss)
        return loss


def call_dict_forward(pl_module, input_ids, attention_mask):
    return pl_module({"input_ids": input_ids, "attention_mask": attention_mask})


class ManualDictForwardGPT(DictForwardGPT):
    """Manual optimization (its training_step is never replayed) and a forward taking the whole dict."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.automatic_optimization = False

    def training_step(self, batch, batch_idx):
        opt = self.optimizers()
        loss = self.loss(self(batch), batch["labels"])
        opt.zero_grad()
        self.manual_backward(loss)
        opt.step()
        return loss


class PiecewiseManualGPT(ManualDictForwardGPT):
    """training_step runs the layers one by one: no single call takes the ids and returns logits, and the forward
    takes a dict, so there is nothing to record and no signature to guess."""

    def training_step(self, batch, batch_idx):
        opt = self.optimizers()
        ids = batch["input_ids"]
        x = self.tok_emb(ids) + self.pos_emb(torch.arange(ids.shape[1]))
        for block in self.blocks:
            x = block(x, batch.get("attention_mask"))
        loss = self.loss(self.head(self.ln_f(x)), batch["labels"])
        opt.zero_grad()
        self.manual_backward(loss)
        opt.step()


def test_cannot_call_says_which_argument_and_stands_aside(tmp_path):
    probe = MaskProbe()
    trainer = make_trainer(tmp_path, [probe], max_steps=2)
    trainer.fit(PiecewiseManualGPT(**SMALL), TinyTextDataModule(batch_size=8))
    assert [f.code for f in probe.findings] == ["TFD211"]
    assert "forward_fn" in probe.findings[0].hint
    assert not probe.active
    assert trainer.global_step == 2  # training went on


@pytest.mark.parametrize("no_causal_mask, expected", [(False, []), (True, ["TFD201"])])
def test_manual_optimization_is_probed_through_the_calls_of_the_real_training_step(tmp_path, no_causal_mask, expected):
    probe = MaskProbe()
    trainer = make_trainer(tmp_path, [probe], max_steps=2)
    trainer.fit(ManualDictForwardGPT(**SMALL, no_causal_mask=no_causal_mask), TinyTextDataModule(batch_size=8))
    assert probe.active and "TFD211" not in [f.code for f in probe.findings]
    assert problems(probe) == expected
    assert "mask_probe/causal_max_change" in probe.last_report


@pytest.mark.parametrize("no_causal_mask, expected", [(False, []), (True, ["TFD201"])])
def test_a_forward_taking_the_whole_batch_is_probed_through_the_call_training_step_makes(
    tmp_path, no_causal_mask, expected
):
    probe = MaskProbe()
    fit(tmp_path, [probe], model=DictForwardGPT(**SMALL, no_causal_mask=no_causal_mask))
    assert probe.active and "TFD211" not in [f.code for f in probe.findings]
    assert problems(probe) == expected


def test_forward_fn_makes_an_unusual_model_callable(tmp_path):
    probe = MaskProbe(forward_fn="tests.callbacks.mask_probe.test_callback:call_dict_forward")
    fit(tmp_path, [probe], model=DictForwardGPT(**SMALL, no_causal_mask=True))
    assert problems(probe) == ["TFD201"]


def test_probes_again_every_n_steps_and_state_round_trips(tmp_path):
    probe = MaskProbe(every_n_steps=2)
    fit(tmp_path, [probe], max_steps=5)
    assert probe._last_probe_step == 4
    restored = MaskProbe(every_n_steps=2)
    restored.load_state_dict(probe.state_dict())
    assert restored._alignment_decided is True
    assert restored._emitted == probe._emitted


# ---------------------------------------------------------------- Hugging Face GPT-2 (random weights, no download)
try:
    import transformers
except ImportError:  # the `test` extra installs it; without it only these tests are skipped
    transformers = None
needs_transformers = pytest.mark.skipif(transformers is None, reason="needs `transformers`")


class HFGPT2(pl.LightningModule):
    def __init__(self):
        super().__init__()
        config = transformers.GPT2Config(
            n_layer=2, n_embd=32, n_head=2, vocab_size=259, n_positions=64, attn_implementation="eager"
        )
        self.model = transformers.GPT2LMHeadModel(config)

    def forward(self, input_ids, attention_mask=None, labels=None):
        return self.model(input_ids=input_ids, attention_mask=attention_mask, labels=labels)

    def training_step(self, batch, batch_idx):
        loss = self(**batch).loss  # Hugging Face shifts the labels inside the model
        self.log("train/loss", loss)
        return loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


@needs_transformers
def test_hugging_face_gpt2_passes(tmp_path):
    probe = MaskProbe()
    fit(tmp_path, [probe], model=HFGPT2(), max_steps=1)
    assert problems(probe) == []
    assert probe.last_report["mask_probe/context_limit"] == 64.0
    assert probe.last_report["mask_probe/loss_returned"] == pytest.approx(
        probe.last_report["mask_probe/loss_shifted"], rel=1e-5
    )


@needs_transformers
def test_hugging_face_gpt2_without_its_causal_mask_is_caught(tmp_path, monkeypatch):
    from transformers import masking_utils
    from transformers.models.gpt2 import modeling_gpt2

    def bidirectional(config, inputs_embeds, attention_mask, past_key_values=None, position_ids=None, **kwargs):
        # the decoder builds an encoder's (padding-only) mask: every position sees the future
        return masking_utils.create_bidirectional_mask(
            config=config, inputs_embeds=inputs_embeds, attention_mask=attention_mask
        )

    monkeypatch.setattr(modeling_gpt2, "create_causal_mask", bidirectional)
    probe = MaskProbe()
    fit(tmp_path, [probe], model=HFGPT2(), max_steps=1)
    assert problems(probe) == ["TFD201"]


def hf_cached_decode(pl_module, input_ids, position_offset=0):
    """Token-by-token decoding with GPT-2's own KV cache (`past_key_values`)."""
    past, logits = None, []
    for t in range(input_ids.shape[1]):
        position_ids = torch.full_like(input_ids[:, :1], t + position_offset)
        out = pl_module.model(input_ids=input_ids[:, t : t + 1], past_key_values=past, position_ids=position_ids)
        past = out.past_key_values
        logits.append(out.logits)
    return torch.cat(logits, dim=1)


def hf_cached_decode_off_by_one(pl_module, input_ids):
    return hf_cached_decode(pl_module, input_ids, position_offset=1)


@needs_transformers
@pytest.mark.parametrize("fn, codes", [("hf_cached_decode", []), ("hf_cached_decode_off_by_one", ["TFD209"])])
def test_hugging_face_gpt2_kv_cache_positions(tmp_path, fn, codes):
    probe = MaskProbe(kv_cache_fn=f"tests.callbacks.mask_probe.test_callback:{fn}", probe_length=12)
    fit(tmp_path, [probe], model=HFGPT2(), max_steps=1)
    assert problems(probe) == codes
    if codes:
        finding = next(f for f in probe.findings if f.code == "TFD209")
        assert finding.evidence["first_position"] == 0  # every cached step is one position off, from the first


# ---------------------------------------------------------------- YAML and DDP
def test_built_from_lightning_cli_yaml(tmp_path):
    from lightning.pytorch.cli import LightningCLI

    config = tmp_path / "config.yaml"
    config.write_text(
        "trainer:\n  callbacks:\n    - class_path: lightning_tfdebug.MaskProbe\n"
        "      init_args: {causal: false, model_kind: decoder, probe_rows: 3, padding_side: left, context_limit: 32,"
        " forward_fn: 'tests.callbacks.mask_probe.test_callback:call_dict_forward'}\n"
    )
    cli = LightningCLI(TinyGPT, TinyTextDataModule, run=False, args=["--config", str(config)])
    [probe] = [c for c in cli.trainer.callbacks if isinstance(c, MaskProbe)]
    assert (probe.causal, probe.probe_rows, probe.padding_side, probe.context_limit) == (False, 3, "left", 32)
    assert probe.forward_fn.endswith("call_dict_forward") and probe.model_kind == "decoder"


@pytest.mark.ddp
def test_ddp_catches_causal_and_label_bugs_on_every_rank(tmp_path):
    spec = {
        "strategy": "ddp",
        "model": {**SMALL, "no_causal_mask": True, "unshifted_labels": True},
        "data": {"batch_size": 4},
        "trainer": {"max_steps": 2},
        "callbacks": [{"class_path": "lightning_tfdebug.MaskProbe"}],
    }
    for r in run_distributed(tmp_path, spec):
        assert r["error"] is None, r["error"]
        codes = sorted({f["code"] for f in r["findings"]["MaskProbe"] if f["severity"] != "info"})
        assert codes == ["TFD201", "TFD205"], (r["rank"], codes)
        assert r["global_step"] == 2


@pytest.mark.ddp
def test_ddp_healthy_run_with_raise_passes_its_retry_steps_together(tmp_path):
    # retry steps 1 and 5 call `resolve_local_findings` (a collective under "raise") on every rank, whether or not a
    # rank still has the target alignment to decide; a healthy run must neither raise nor hang
    spec = {
        "strategy": "ddp",
        "model": SMALL,
        "data": {"batch_size": 4},
        "trainer": {"max_steps": 6},
        "callbacks": [{"class_path": "lightning_tfdebug.MaskProbe", "init_args": {"on_finding": "raise"}}],
    }
    for r in run_distributed(tmp_path, spec):
        assert r["error"] is None, r["error"]
        assert [f["code"] for f in r["findings"]["MaskProbe"]] == ["TFD208"]
        assert r["metrics"]["mask_probe/causal_max_change"] == 0.0
        assert r["global_step"] == 6


# ------------------------------------------------------------------ batch types (the shared reading of core.batch)
@pytest.mark.parametrize("model_class", [DataclassBatchGPT, BatchEncodingGPT])
@pytest.mark.parametrize(
    "flag, code",
    [(None, None), ("no_causal_mask", "TFD201"), ("no_padding_mask", "TFD202"), ("unshifted_labels", "TFD205")],
)
def test_dataclass_and_batch_encoding_batches_are_read(tmp_path, model_class, flag, code):
    """Ids, mask and labels are found in dataclass and BatchEncoding batches: each bug that needs one of them to be
    seen is named, and the healthy model is silent."""
    pytest.importorskip("transformers")
    probe = MaskProbe()
    fit(tmp_path, [probe], model=model_class(**SMALL, **({flag: True} if flag else {})))
    expected = [] if code in (None, "TFD202") else [code]  # a mask ignored on right padding: info, saying so
    assert problems(probe) == expected and (code != "TFD202" or any(f.code == code for f in probe.findings))
    assert probe.active and "mask_probe/padding_max_change" in probe.last_report


def test_keys_point_at_fields_with_other_names(tmp_path):
    """``input_key`` / ``mask_key`` / ``labels_key`` as dotted paths into a nested batch with unusual names."""

    class NestedGPT(TinyGPT):
        def on_after_batch_transfer(self, batch, dataloader_idx):
            return {"text": {"codes": batch["input_ids"], "keep": batch["attention_mask"]}, "gold": batch["labels"]}

        def training_step(self, batch, batch_idx):
            return self.loss(self(batch["text"]["codes"], batch["text"]["keep"]), batch["gold"])

    probe = MaskProbe(input_key="text.codes", mask_key="text.keep", labels_key="gold")
    fit(tmp_path / "a", [probe], model=NestedGPT(**SMALL, unshifted_labels=True))
    assert problems(probe) == ["TFD205"]
    blind = MaskProbe(input_key="text.codes", mask_key="text.keep", labels_key="gold")
    fit(tmp_path / "b", [blind], model=NestedGPT(**SMALL, no_padding_mask=True))
    assert [f.code for f in blind.findings if f.code == "TFD202"] == ["TFD202"]  # info: harmless on right padding


@pytest.mark.parametrize("every_n_steps, probing", [(None, {0}), (3, {0, 3, 6})])
def test_steps_that_do_not_probe_cost_nothing(tmp_path, every_n_steps, probing):
    """No tensor op, no host sync on a step that does not probe (the retry steps of a decided alignment included)."""
    calls = TorchCalls()
    fit(tmp_path, calls.around(MaskProbe(every_n_steps=every_n_steps)), max_steps=7)
    assert set(calls.counts) == probing


class _BertWithPositionIds(pl.LightningModule):
    """Hugging Face BERT (masked LM), the healthy matrix's tiny config; ``zero_positions`` passes ``position_ids`` of
    zeros in the step (bug-zoo row 28 on a family the bug matrix does not use for it)."""

    def __init__(self, zero_positions: bool) -> None:
        super().__init__()
        from tests.healthy_models import hf_model

        self.model, self.zero_positions = hf_model("bert_mlm"), zero_positions

    def training_step(self, batch, batch_idx):
        extra = {"position_ids": torch.zeros_like(batch["input_ids"])} if self.zero_positions else {}
        return self.model(**batch, **extra).loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


@pytest.mark.parametrize("zero_positions", [True, False], ids=["position_ids_zero", "healthy"])
def test_position_ids_all_zero_on_bert(tmp_path, zero_positions):
    pytest.importorskip("transformers")
    from tests.healthy_models import data

    probe = MaskProbe()
    trainer = make_trainer(tmp_path, [probe], max_steps=2)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.fit(_BertWithPositionIds(zero_positions), data("bert_mlm"))
    if zero_positions:
        assert problems(probe) == ["TFD216"]
        finding = next(f for f in probe.findings if f.code == "TFD216")
        assert finding.severity == "warning" and finding.evidence["kind"] == "constant"
        assert finding.evidence["table"] == "model.bert.embeddings.position_embeddings.weight"
    else:  # its token-type table is looked up with zeros too, but has 2 rows: not a position table
        assert problems(probe) == []


class BareRowsLM(pl.LightningModule):
    """No config, no labels: batches of token ids only, a next-token loss in the step. Its kind cannot be told."""

    def __init__(self) -> None:
        super().__init__()
        self.emb, self.head = torch.nn.Embedding(32, 16), torch.nn.Linear(16, 32)

    def forward(self, ids):
        return self.head(self.emb(ids).mean(1, keepdim=True) + self.emb(ids))  # every position sees every token

    def training_step(self, batch, batch_idx):
        logits = self(batch[0])
        return F.cross_entropy(logits[:, :-1].flatten(0, 1), batch[0][:, 1:].flatten())

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


@pytest.mark.parametrize("model_kind, expected", [(None, []), ("decoder", ["TFD201"])])
def test_a_model_of_unknown_kind_is_left_unjudged_with_one_line_naming_model_kind(tmp_path, model_kind, expected):
    rows = torch.randint(0, 32, (8, 12), generator=torch.Generator().manual_seed(0))
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(rows), batch_size=4)
    probe = MaskProbe(model_kind=model_kind, check_padding=False)
    fit(tmp_path, [probe], model=BareRowsLM(), data=loader, max_steps=1)
    assert problems(probe) == expected
    aside = probe.checks_aside.get("causality and target alignment", "")
    assert ("`model_kind`" in aside) == (model_kind is None), probe.checks_aside


def test_samples_mixed_across_the_batch_and_a_probe_of_one_sample(tmp_path):
    """TFD217 when one sample's tokens move another's logits (attention over the batch axis); with one probe row the
    cross-sample probe stands aside, recorded."""
    from tests.bug_models import BugTinyGPT

    probe = MaskProbe()
    fit(tmp_path / "mixed", [probe], model=BugTinyGPT(batch_axis_attention=True), max_steps=1)
    [mixed] = [f for f in probe.findings if f.code == "TFD217"]
    assert mixed.severity == "error" and mixed.evidence["row"] == 1
    assert mixed.evidence["max_change"] > mixed.evidence["tolerance"]
    one = MaskProbe(probe_rows=1)
    fit(tmp_path / "one", [one], max_steps=1)
    assert problems(one) == [] and "cross-sample probe (TFD217)" in one.checks_aside


def test_a_masked_lm_whose_positions_count_the_real_tokens_is_silent(tmp_path):
    """Replacement ids are never the pad id (which would move such a model's positions); with no tokenizer or config
    naming special ids the probe says where it drew them from."""
    from tests.healthy_models import PadPositionMLM, data

    probe = MaskProbe(every_n_steps=1)
    fit(tmp_path, [probe], model=PadPositionMLM(), data=data("bert_mlm"), max_steps=3)
    assert problems(probe) == [] and probe.last_report["mask_probe/padding_max_change"] == 0.0
    assert "special ids" in probe.checks_aside
