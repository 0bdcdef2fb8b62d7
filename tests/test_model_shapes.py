"""The probes reach the models users actually write (issue "Reach the models users actually write").

On each shape (tuple batches, ``forward(src, tgt)``, log-probabilities flattened to ``(N*T, V)`` with NLL, a module
without ``forward`` that calls ``self.model(x, y)``, Hugging Face models with the labels inside the call) an injected
leak is caught, the healthy control is silent, and no probe stands aside.
"""

from __future__ import annotations

import math

import pytest
import torch

from lightning_tfdebug import LossAtInit, MaskProbe
from tests.helpers import fit_tiny, read_scalars
from tests.wild_models import (
    HFSeq2Seq,
    MiniGPTModule,
    Seq2SeqModule,
    TokenRowLM,
    cipher_pairs,
    lightning_demo_transformer,
    stream_pairs,
    token_rows,
)

transformers = pytest.importorskip("transformers")


def codes(callback) -> list[str]:
    return sorted({f.code for f in callback.findings})


def assert_ran(*callbacks) -> None:
    for cb in callbacks:
        assert cb._aside_reason is None, f"{type(cb).__name__} stood aside: {cb._aside_reason}"
        assert not {"TFD211", "TFD228"} & set(codes(cb)), [f.message for f in cb.findings]


def test_the_lightning_demo_transformer_leaks_its_targets_and_every_probe_runs(tmp_path):
    """Lightning's own demo: tuple batches, forward(inputs, target), (N*T, V) log-probs, NLL. Its decoder reads
    `target` at the positions it predicts, and its encoder reads the whole input: both are reported."""
    probe, init = MaskProbe(), LossAtInit(check_step=None)
    fit_tiny(tmp_path, [probe, init], model=lightning_demo_transformer(), data=stream_pairs(), max_steps=1)
    assert_ran(probe, init)
    found = {f.code: f for f in probe.findings}
    assert "TFD214" in found and found["TFD214"].evidence["argument"] == "target"
    assert "TFD201" in found and found["TFD201"].evidence["argument"] == "inputs"
    # LossAtInit read the flattened log-probabilities against the (16, 35)-shaped tuple labels: loss near ln(V)
    scalars = read_scalars(tmp_path / "tb" / "version_0")
    loss = scalars["loss_at_init/loss"][0][1]
    assert loss == pytest.approx(math.log(259), rel=0.25)


@pytest.mark.parametrize(
    "bug, expected",
    [(None, set()), ("unshifted_decoder_input", {"TFD214"}), ("no_decoder_mask", {"TFD214"})],
)
def test_forward_src_tgt_encoder_decoder(tmp_path, bug, expected):
    """nn.Transformer with forward(src, tgt), a cipher task: the source is not the labels, so the encoder may see
    all of it; the decoder input must be the labels shifted right, under a causal mask."""
    probe, init = MaskProbe(), LossAtInit(check_step=None)
    fit_tiny(tmp_path, [probe, init], model=Seq2SeqModule(bug=bug), data=cipher_pairs(), max_steps=1)
    assert_ran(probe, init)
    problems = {f.code for f in probe.findings if f.severity != "info"}
    assert problems == expected
    if expected:
        leak = next(f for f in probe.findings if f.code == "TFD214")
        assert leak.evidence["argument"] == "tgt"


@pytest.mark.parametrize("bug, expected", [(None, set()), ("no_causal_mask", {"TFD201"})])
def test_a_small_gpt_called_as_self_model_x_y(tmp_path, bug, expected):
    """No forward on the LightningModule; `logits, loss = self.model(x, y)`; without targets the model would return
    only the last position's logits, so the probe must keep passing the targets it was called with."""
    probe, init = MaskProbe(), LossAtInit(check_step=None)
    fit_tiny(tmp_path, [probe, init], model=MiniGPTModule(bug=bug), data=stream_pairs(), max_steps=1)
    assert_ran(probe, init)
    assert {f.code for f in probe.findings if f.severity != "info"} == expected
    assert probe.last_report["mask_probe/loss_returned"] == pytest.approx(
        probe.last_report["mask_probe/loss_unshifted"], rel=1e-4
    )  # the loss of the recorded call, aligned with the data's next-token labels


@pytest.mark.parametrize("bug, expected", [(None, set()), ("decoder_input_is_labels", {"TFD214"})])
def test_hugging_face_encoder_decoder_with_labels_inside(tmp_path, bug, expected):
    from torch.utils.data import DataLoader

    from tests.healthy_models import _documents, seq2seq_collate

    data = DataLoader(_documents(), batch_size=8, collate_fn=seq2seq_collate)
    probe = MaskProbe()
    fit_tiny(tmp_path, [probe], model=HFSeq2Seq(bug=bug), data=data, max_steps=1)
    assert_ran(probe)
    assert {f.code for f in probe.findings if f.severity != "info"} == expected
    if expected:
        assert next(f for f in probe.findings if f.code == "TFD214").evidence["argument"] == "decoder_input_ids"


def test_hugging_face_decoder_with_labels_inside_is_probed_on_the_labels_too(tmp_path):
    from tests.healthy_models import HFLM, data

    class LabelsInside(HFLM):
        def training_step(self, batch, batch_idx):
            ids, mask = batch["input_ids"], batch["attention_mask"]
            return self.model(input_ids=ids, attention_mask=mask, labels=ids.masked_fill(mask == 0, -100)).loss

    probe = MaskProbe()
    fit_tiny(tmp_path, [probe], model=LabelsInside("gpt2"), data=data("gpt2"), max_steps=1)
    assert_ran(probe)
    assert [f.code for f in probe.findings if f.severity != "info"] == []
    assert "mask_probe/causal_max_change" in probe.last_report
    assert "mask_probe/padding_max_change" in probe.last_report  # the mask in the call was found and probed


def test_a_call_without_the_batch_mask_is_named(tmp_path):
    """The recorded call shows the model is called without the batch's mask: TFD204, from what really happened."""
    from tests.healthy_models import HFLM, data

    class MaskDropped(HFLM):
        def training_step(self, batch, batch_idx):
            return self.model(input_ids=batch["input_ids"], labels=batch["input_ids"]).loss

    probe = MaskProbe()
    fit_tiny(tmp_path, [probe], model=MaskDropped("gpt2"), data=data("gpt2"), max_steps=1)
    assert_ran(probe)
    [dropped] = [f for f in probe.findings if f.code == "TFD204"]
    assert dropped.severity == "info" and "Harmless for this run's batches" in dropped.message  # right padding


def test_recorded_call_restores_modes_and_leaves_no_hooks(tmp_path):
    module = Seq2SeqModule()
    fit_tiny(tmp_path, [MaskProbe()], model=module, data=cipher_pairs(), max_steps=2)
    assert module.training
    for m in module.modules():
        assert not m._forward_hooks and not m._forward_pre_hooks
    assert isinstance(next(module.parameters()), torch.nn.Parameter)


HEALTHY_SHAPES = {
    "seq2seq_forward_src_tgt": (lambda: Seq2SeqModule(), cipher_pairs),
    "small_gpt_self_model_x_y": (lambda: MiniGPTModule(), stream_pairs),
    # token rows (B, T+1), no labels; `self.model(batch)` is a wrapper that shifts them and returns only the loss
    "token_rows_loss_only_wrapper": (lambda: TokenRowLM("shift_inside"), token_rows),
    # the step slices the rows itself: `x, y = batch[:, :-1], batch[:, 1:]; logits = self.model(x)`
    "token_rows_sliced_in_the_step": (lambda: TokenRowLM("step_slices"), token_rows),
    # padded rows with their mask, both sliced by the wrapper and passed to the inner network
    "token_rows_padded_with_a_mask": (lambda: TokenRowLM(), lambda rows: token_rows(rows=rows, padded=True)),
}


@pytest.mark.parametrize("shape", sorted(HEALTHY_SHAPES))
def test_the_pack_at_its_defaults_is_silent_on_the_healthy_shapes(tmp_path, shape):
    """The healthy-matrix rule on these shapes: every callback at its defaults, no warning and no error, and no check
    stood aside. LossAtInit's later check (step 100) runs too."""
    from tests.healthy_models import the_pack_at_defaults

    build, loader = HEALTHY_SHAPES[shape]
    pack = the_pack_at_defaults()
    fit_tiny(tmp_path, pack, model=build(), data=loader(rows=960), max_steps=110)
    assert [f.format() for c in pack for f in c.findings if f.severity in ("warning", "error")] == []
    aside = {type(c).__name__: c._aside_reason for c in pack if c._aside_reason is not None}
    # the sharded-strategy and precision checks that do not apply to a single-device fp32 run are the only ones out
    assert set(aside) <= {"ScalerWatch", "CheckpointAudit"}, aside


@pytest.mark.parametrize("family", ["small_gpt", "seq2seq"])
@pytest.mark.parametrize("broken", [False, True])
def test_a_model_that_positions_do_not_reach_is_named_once_it_has_trained(tmp_path, family, broken):
    """TFD215 from the mechanism (an output invariant to the order of the tokens before it, not to their content) on
    a decoder-only model and an encoder-decoder whose position table gives every position the same vector (as the
    Lightning demo's `pe[:, x.size(1)]` does); silent when the positions reach the attention."""
    if family == "small_gpt":
        module, loader = MiniGPTModule(), stream_pairs(rows=1700)
        table = module.model.wpe
    else:
        module, loader = Seq2SeqModule(), cipher_pairs(rows=1700)
        table = module.model.pos
    if broken:
        torch.nn.init.zeros_(table.weight)
        table.weight.requires_grad_(False)
    probe = MaskProbe()
    fit_tiny(tmp_path, [probe], model=module, data=loader, max_steps=101)
    assert_ran(probe)
    order = [f for f in probe.findings if f.code == "TFD215"]
    assert bool(order) == broken, [f.message for f in probe.findings]
    assert probe.last_report["mask_probe/content_change"] > 0
