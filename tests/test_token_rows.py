"""The probes reach the loss-only wrappers over token rows (issue 24, bug-zoo row 33).

The batch is one integer tensor of token rows ``(B, T+1)`` (or a list whose first item is one), with no labels; the
step returns ``self.model(batch)``, a wrapper that slices the rows itself, calls its inner network (a grandchild of
the LightningModule, returning ``(logits, cache)``) and returns only the loss; or the step slices the rows and calls
the network itself; or the wrapper feeds the whole row and drops the last logit. On each: every check runs (nothing
stands aside), the healthy model is silent, the library's encoder stack used as a causal LM is a leak (TFD201),
unshifted targets are TFD205, and probabilities scored by cross-entropy again are TFD220 (LossAtInit through the
inner call). A batch with no integer tensor at all makes the token probes stand aside once, naming the settings.
"""

from __future__ import annotations

import dataclasses
import json
import math

import pytest
import torch
import torch.nn.functional as F

from lightning_tfdebug import LossAtInit, MaskProbe
from lightning_tfdebug.functional.loss import unigram_entropy
from lightning_tfdebug.functional.probes import alignment_losses
from lightning_tfdebug.primitives.call_finder import find_model_call
from lightning_tfdebug.primitives.calls import record_calls, takes_tokens
from tests.helpers import fit_tiny, read_scalars
from tests.wild_models import (
    STYLES,
    EmbeddingRowsLM,
    RowNet,
    ShiftInsideWrapper,
    TokenRowLM,
    embedding_rows,
    token_rows,
)

LN_V = math.log(259)


def assert_ran(*callbacks) -> None:
    for cb in callbacks:
        assert cb._aside_reason is None, f"{type(cb).__name__} stood aside: {cb._aside_reason}"
        assert not {"TFD211", "TFD228"} & {f.code for f in cb.findings}, [f.message for f in cb.findings]


def problems(*callbacks) -> set[str]:
    return {f.code for cb in callbacks for f in cb.findings if f.severity in ("warning", "error")}


# ------------------------------------------------------------------------------------------------ on plain tensors
def test_nested_recording_keeps_the_inner_call_in_start_order():
    torch.manual_seed(0)
    wrapper = ShiftInsideWrapper(RowNet())
    rows = torch.randint(0, 200, (2, 9))
    loss, outermost = record_calls(wrapper, lambda: wrapper(rows))
    assert [type(c.module).__name__ for c in outermost] == ["ShiftInsideWrapper"]  # the default is unchanged
    loss, calls = record_calls(wrapper, lambda: wrapper(rows), nested=True, want=takes_tokens)
    assert [(type(c.module).__name__, c.depth) for c in calls] == [("ShiftInsideWrapper", 0), ("RowNet", 1)]
    assert torch.equal(calls[1].args[0], rows[:, :-1])  # the embedding lookup is not kept: its output is not logits
    found = find_model_call(calls, rows)
    assert not isinstance(found, str) and found.kind == "loss-only wrapper"
    chosen = found.token_rows(rows, None)
    assert chosen is not None
    logits, labels, tokens = chosen
    assert logits.shape == (2, 8, 259) and torch.equal(tokens, rows[:, :-1]) and torch.equal(labels, tokens)
    assert F.cross_entropy(logits.flatten(0, 1), rows[:, 1:].flatten()).item() == pytest.approx(loss.item())


@pytest.mark.parametrize("columns, start", [((0, None), 0), ((0, -1), 0), ((1, None), 1)])
def test_the_plan_reads_which_columns_of_the_rows_the_call_received(columns, start):
    torch.manual_seed(0)
    net = RowNet()
    rows = torch.randint(0, 200, (2, 10))
    _, calls = record_calls(net, lambda: net(rows[:, columns[0] : columns[1]]), nested=True, want=takes_tokens)
    plan = find_model_call(calls, rows)
    assert not isinstance(plan, str) and plan.primary is not None
    assert (plan.ids_start, plan.ids_stop) == columns and plan.sliced == (columns != (0, None))
    # without labels, output p of a call fed the rows from column `start` on is trained on the row's token
    # p + start + 1 (shift `start` against the rows' next tokens), so it must not read the call's own tokens from
    # position p + 1 on (shift + offset = 1): the leak probe perturbs from there
    assert plan.shift == start and plan.shift + plan.primary.offset == 1


@dataclasses.dataclass
class _Out:
    scores: torch.Tensor
    cache: list


class StructuredNet(torch.nn.Module):
    """An inner network whose output is a dict or a dataclass, the logits under a name of its own."""

    def __init__(self, wrap: str) -> None:
        super().__init__()
        self.net, self.wrap = RowNet(), wrap

    def forward(self, ids):
        logits, cache = self.net(ids)
        return {"scores": logits, "cache": cache} if self.wrap == "dict" else _Out(logits, cache)


class ReturnsInnerOutput(torch.nn.Module):
    """A wrapper fed the whole rows that returns its inner network's output for ``rows[:, :-1]``."""

    def __init__(self, inner: torch.nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, rows):
        return self.inner(rows[:, :-1])


@pytest.mark.parametrize("wrap", ["dict", "dataclass"])
def test_the_first_float_tensor_of_a_dict_or_dataclass_output_is_read_as_the_logits(wrap):
    torch.manual_seed(0)
    wrapper = ReturnsInnerOutput(StructuredNet(wrap))
    rows = torch.randint(0, 200, (2, 10))
    _, calls = record_calls(wrapper, lambda: wrapper(rows), nested=True, want=takes_tokens)
    # the wrapper takes the rows and returns 9 positions of logits: the inner call that received rows[:, :-1] and
    # returned one output per position of it is the one probed
    plan = find_model_call(calls, rows)
    assert not isinstance(plan, str) and isinstance(plan.call.module, StructuredNet) and plan.sliced
    chosen = plan.token_rows(rows, None)
    assert chosen is not None and chosen[0].shape == (2, 9, 259)


def test_alignment_losses_read_a_slice_against_the_whole_row():
    torch.manual_seed(0)
    rows = torch.randint(0, 50, (3, 9))
    logits = torch.randn(3, 8, 50)  # the outputs of rows[:, :-1]
    losses = alignment_losses(logits, rows)
    expected = F.cross_entropy(logits.flatten(0, 1), rows[:, 1:].flatten())  # every position has its next token
    assert losses["shifted"].item() == pytest.approx(expected.item())
    assert losses["unshifted"].item() == pytest.approx(F.cross_entropy(logits.flatten(0, 1), rows[:, :-1].flatten()))
    tail = alignment_losses(logits, rows, offset=1)  # the outputs of rows[:, 1:]: output p stands at row p + 1
    assert tail["unshifted"].item() == pytest.approx(F.cross_entropy(logits.flatten(0, 1), rows[:, 1:].flatten()))
    assert tail["shifted"].item() == pytest.approx(F.cross_entropy(logits[:, :7].flatten(0, 1), rows[:, 2:].flatten()))
    same = alignment_losses(logits, rows[:, :-1])  # logits and labels of one length: as before
    assert same["shifted"].item() == pytest.approx(
        F.cross_entropy(logits[:, :-1].flatten(0, 1), rows[:, 1:-1].flatten()).item()
    )


# ------------------------------------------------------------------------------------------------ real Trainers
@pytest.mark.parametrize("as_list", [False, True], ids=["bare", "list"])
@pytest.mark.parametrize("style", STYLES)
def test_healthy_token_row_models_are_silent_and_every_check_runs(tmp_path, style, as_list):
    probe, init = MaskProbe(), LossAtInit(check_step=None)
    fit_tiny(tmp_path, [probe, init], model=TokenRowLM(style), data=token_rows(as_list=as_list), max_steps=2)
    assert_ran(probe, init)
    assert problems(probe, init) == set()
    report = probe.last_report
    # causality (the leak probe on the call's own tokens), determinism, the context limit and the target alignment
    # all ran on the recorded inner call
    for key in ("causal_max_change", "repeat_max_change", "context_limit", "loss_returned", "loss_shifted"):
        assert f"mask_probe/{key}" in report, sorted(report)
    assert report["mask_probe/loss_returned"] == pytest.approx(report["mask_probe/loss_shifted"], rel=1e-5)
    scalars = read_scalars(tmp_path / "tb" / "version_0")
    observed = scalars["loss_at_init/observed"][0][1]
    assert observed == pytest.approx(LN_V, rel=0.05)
    assert scalars["loss_at_init/expected"][0][1] == pytest.approx(LN_V)
    # the cross-entropy of the inner call's logits against the rows' next tokens (all but the slice's last one)
    assert scalars["loss_at_init/recomputed"][0][1] == pytest.approx(observed, rel=0.02)
    assert "loss_at_init/copy_rate" in scalars  # the tokens the call received were found for the copy check


@pytest.mark.parametrize("style", STYLES)
def test_the_encoder_stack_used_as_a_causal_lm_is_a_leak(tmp_path, style):
    probe, init = MaskProbe(), LossAtInit(check_step=None)
    fit_tiny(tmp_path, [probe, init], model=TokenRowLM(style, bug="encoder"), data=token_rows(), max_steps=1)
    assert_ran(probe, init)
    assert problems(probe, init) == {"TFD201"}
    leak = next(f for f in probe.findings if f.code == "TFD201")
    assert leak.evidence["argument"] == "ids"  # the inner network's own argument


@pytest.mark.parametrize("style", STYLES)
def test_unshifted_targets_are_flagged(tmp_path, style):
    probe = MaskProbe()
    fit_tiny(tmp_path, [probe], model=TokenRowLM(style, bug="unshifted"), data=token_rows(), max_steps=1)
    assert_ran(probe)
    assert problems(probe) == {"TFD205"}


@pytest.mark.parametrize("bug, expected", [(None, set()), ("mask_ignored", {"TFD202"})])
def test_padded_rows_sliced_with_their_mask_run_the_padding_probes(tmp_path, bug, expected):
    """``{"input_ids", "attention_mask"}`` batches whose wrapper slices both and passes the mask to the inner
    network: the mask is found in the inner call as the slice of the batch's mask, and the padding probes vary it."""
    probe, init = MaskProbe(), LossAtInit(check_step=None)
    fit_tiny(tmp_path, [probe, init], model=TokenRowLM(bug=bug), data=token_rows(padded=True), max_steps=1)
    assert_ran(probe, init)
    assert problems(probe, init) == set()  # the mask ignored on right-padded rows of a causal LM: info, harmless
    assert {f.code for f in probe.findings if f.code == "TFD202"} == expected
    assert {"mask_probe/padding_max_change", "mask_probe/pad_side_max_change"} <= set(probe.last_report)
    # the padding is not a target of the wrapper's loss, nor of the alignment read against the rows
    assert probe.last_report["mask_probe/loss_returned"] == pytest.approx(
        probe.last_report["mask_probe/loss_shifted"], rel=1e-5
    )


def test_loss_at_init_reads_the_inner_calls_outputs(tmp_path):
    """The inner network returns probabilities and the wrapper scores them by cross-entropy again (bug-zoo row 1):
    LossAtInit finds that in the outputs of the call the step never makes itself."""
    init = LossAtInit(check_step=None)
    fit_tiny(tmp_path, [init], model=TokenRowLM(bug="probabilities"), data=token_rows(), max_steps=1)
    assert_ran(init)
    assert "TFD220" in problems(init)


def test_loss_at_init_counts_the_unigram_entropy_of_the_rows(tmp_path):
    init = LossAtInit(check_step=30, every_n_steps=1)
    data = token_rows(rows=256)
    fit_tiny(tmp_path, [init], model=TokenRowLM(), data=data, max_steps=31)
    assert_ran(init)
    assert problems(init) == set()
    rows = torch.cat([b for _, b in zip(range(8), data)])  # the first 8 measured batches (steps 0-7, not shuffled)
    # every token after a row's first is a next-token target; the entropy estimate is the pack's (Miller-Madow)
    entropy = float(unigram_entropy(torch.bincount(rows[:, 1:].flatten(), minlength=259)))
    scalars = read_scalars(tmp_path / "tb" / "version_0")
    assert scalars["loss_at_init/unigram_entropy"][-1][1] == pytest.approx(entropy, rel=1e-4)
    assert scalars["loss_at_init/check_loss"][0][1] < entropy  # learned more than the token frequencies


def test_a_batch_without_integer_tensors_makes_the_token_probes_stand_aside_once(tmp_path):
    probe = MaskProbe(every_n_steps=1)
    fit_tiny(tmp_path, [probe], model=EmbeddingRowsLM(), data=embedding_rows(), max_steps=3)
    assert [f.code for f in probe.findings] == ["TFD211"]
    assert "no integer tensor" in probe._aside_reason and "float32 (8, 13, 16)" in probe._aside_reason
    assert "`input_key`" in probe._aside_setting and "`forward_fn`" in probe._aside_setting
    lines = (tmp_path / "tb" / "version_0" / "tfdebug" / "stood-aside-rank0.jsonl").read_text().splitlines()
    records = [json.loads(line) for line in lines]
    assert [r["setting"] for r in records if r["check"] == "MaskProbe"] == [probe._aside_setting]


class ManualTokenRowLM(TokenRowLM):
    """The loss-only wrapper under manual optimization: the step is never replayed, so the calls of the real one are
    recorded, at every depth."""

    def __init__(self, bug: str | None = None) -> None:
        super().__init__(bug=bug)
        self.automatic_optimization = False

    def training_step(self, batch, batch_idx):
        optimizer = self.optimizers()
        loss = super().training_step(batch, batch_idx)
        optimizer.zero_grad()
        self.manual_backward(loss)
        optimizer.step()
        return loss


@pytest.mark.parametrize("bug, expected", [(None, set()), ("encoder", {"TFD201"})])
def test_manual_optimization_records_the_inner_call_of_the_real_step(tmp_path, bug, expected):
    probe, init = MaskProbe(), LossAtInit(check_step=None)
    fit_tiny(tmp_path, [probe, init], model=ManualTokenRowLM(bug=bug), data=token_rows(), max_steps=1)
    assert_ran(probe, init)
    assert problems(probe, init) == expected
    assert "mask_probe/causal_max_change" in probe.last_report
