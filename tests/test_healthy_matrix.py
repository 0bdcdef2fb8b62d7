"""The healthy matrix: every callback of the pack at its defaults on healthy runs of six model families, in the ways
people train them, must raise no warning and no error.

Families (``tests/healthy_models.py``, tiny configs, nothing downloaded): the bundled TinyGPT, a causal LM on
``nn.TransformerEncoder`` with tuple batches, Hugging Face GPT-2, Llama, BERT (masked LM) and T5; beside them BART and a
T5 taught to reproduce its input (:data:`SEQ2SEQ_CASES`); and, fresh with a warm-up, the transformers that do not read
token ids of ``tests/kind_models.py`` (:data:`~tests.healthy_models.KIND_FAMILIES`). Settings: fresh from scratch with
a warm-up; a constant learning rate without warm-up; resumed from a checkpoint past the warm-up; fine-tuning weights
trained first in the test, fully and with LoRA adapters; bf16-mixed; gradient accumulation 4; DDP with 2 processes.
Runs are long enough for every check of the pack to run: LossAtInit's checks at its default ``check_step`` (100), and
at 5x that for the masked LM, whose plateau check needs it.

The matrix runs under ``-m "slow or not slow"`` (CI runs it beside the default run, which holds none of its cases).
``docs/healthy-runs.md`` lists what the pack says (its info findings) on each family. Set ``TFD_HEALTHY_REPORT=<file>``
to append every case's findings to a JSON-lines file (how that table was made)."""

from __future__ import annotations

import json
import os
import warnings
from pathlib import Path

import pytest

from lightning_tfdebug import TFDebugWarning
from lightning_tfdebug.rules import RULES
from tests.floor_models import Gemma2LM, SmoothedEncoderLM, SmoothedHFLM, SmoothedTinyGPT
from tests.healthy_models import (
    EXTRA_FAMILIES,
    FAMILIES,
    KIND_FAMILIES,
    PACK_NAMES,
    SEQ2SEQ_FAMILIES,
    build,
    data,
    pretrain,
    quiet_fit,
    split_data,
    the_pack_at_defaults,
    with_lora,
)
from tests.helpers import BusyLoops, make_trainer, run_distributed

pytest.importorskip("transformers")

CHECK_STEP = 100  # LossAtInit's default check_step
STEPS = {family: CHECK_STEP + 20 for family in FAMILIES + EXTRA_FAMILIES + SEQ2SEQ_FAMILIES + ("gemma",)}
STEPS |= {"bert_mlm": 5 * CHECK_STEP + 20, "mlm_padpos": 5 * CHECK_STEP + 20}
STEPS |= {family: CHECK_STEP + 20 for family in KIND_FAMILIES}
SETTINGS = ("fresh_warmup", "constant_lr", "resumed", "finetune_full", "finetune_lora", "bf16", "accum4")

EXTRA = (("gpt2", "clip_norm"), ("t5", "clip_norm"), ("gemma", "fresh_warmup"))
"""Cases beyond the families x settings: norm clipping at 1.0, and Gemma with a small init (its weights grow 2x)."""
EXTRA += (("tinygpt", "val_split"), ("gpt2", "val_split"), ("bert_mlm", "val_split"))
"""And a held-out validation split read every 50 steps and by the sanity check (its natural duplicates of short
documents stay): the leakage check (TFD126) must stay silent."""

KNOWN: dict[tuple[str, str], str] = {}
"""Cases where a callback still raises a false alarm: ``(family, setting) -> reason`` (marked xfail, not strict)."""


def problems(pack) -> list[str]:
    """Every warning and error of the pack, with its evidence (a failure shows the numbers behind a false alarm)."""
    return [
        f"{f.format()} evidence={f.evidence}" for c in pack for f in c.findings if f.severity in ("warning", "error")
    ]


def report(case: str, pack) -> None:
    path = os.environ.get("TFD_HEALTHY_REPORT")
    if not path:
        return
    with open(path, "a") as f:
        for c in pack:
            for finding in c.findings:
                row = {"case": case, "code": finding.code, "severity": finding.severity, "step": finding.step}
                f.write(json.dumps(row | {"evidence": finding.evidence}, default=str) + "\n")


def run_case(tmp_path: Path, family: str, setting: str) -> list:
    """Fit ``family`` under ``setting`` with the whole pack at its defaults; return the pack."""
    steps = STEPS[family]
    trainer_kwargs: dict = dict(max_steps=steps, log_every_n_steps=10)
    ckpt_path = None
    if setting == "constant_lr":
        module = build(family, warmup_steps=0)
    elif setting == "resumed":
        module = build(family)
        first = quiet_fit(tmp_path / "first", module, family, 30)  # past the 10-step warm-up
        ckpt_path = tmp_path / "resume.ckpt"
        first.save_checkpoint(ckpt_path)
        module = build(family)
        trainer_kwargs["max_steps"] = 30 + steps
    elif setting in ("finetune_full", "finetune_lora"):
        weights = pretrain(tmp_path, family)
        lora = setting == "finetune_lora"
        module = build(family, lr=1e-3 if lora else 2e-4)
        module.load_state_dict(weights)
        if lora:
            module = with_lora(module, family)
    else:
        module = build(family)
    if setting == "bf16":
        trainer_kwargs["precision"] = "bf16-mixed"
    if setting == "accum4":
        trainer_kwargs["accumulate_grad_batches"] = 4
    if setting == "clip_norm":
        trainer_kwargs["gradient_clip_val"] = 1.0
    if setting == "val_split":
        trainer_kwargs |= {"limit_val_batches": 1.0, "val_check_interval": 50}
    pack = the_pack_at_defaults()
    trainer = make_trainer(tmp_path, pack, **trainer_kwargs)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", TFDebugWarning)
        trainer.fit(module, split_data(family) if setting == "val_split" else data(family), ckpt_path=ckpt_path)
    assert trainer.global_step == trainer_kwargs["max_steps"]
    for finding in (f for c in pack for f in c.findings):  # every finding is a registered rule's, from its owner
        assert RULES[finding.code].source == finding.source, finding.format()
    report(f"{family}/{setting}", pack)
    return pack


def cases():
    for family in FAMILIES:
        for setting in SETTINGS:
            marks = [pytest.mark.slow]
            if (family, setting) in KNOWN:
                marks.append(pytest.mark.xfail(strict=False, reason=KNOWN[family, setting]))
            yield pytest.param(family, setting, marks=marks, id=f"{family}-{setting}")
    for family in EXTRA_FAMILIES:
        yield pytest.param(family, "constant_lr", marks=[pytest.mark.slow], id=f"{family}-constant_lr")
    for family, setting in SEQ2SEQ_CASES:
        marks = [pytest.mark.slow]
        if (family, setting) in KNOWN:
            marks.append(pytest.mark.xfail(strict=False, reason=KNOWN[family, setting]))
        yield pytest.param(family, setting, marks=marks, id=f"{family}-{setting}")
    for family, setting in EXTRA:
        yield pytest.param(family, setting, marks=[pytest.mark.slow], id=f"{family}-{setting}")
    for family in KIND_FAMILIES:
        marks = [pytest.mark.slow]
        if (family, "fresh_warmup") in KNOWN:
            marks.append(pytest.mark.xfail(strict=False, reason=KNOWN[family, "fresh_warmup"]))
        yield pytest.param(family, "fresh_warmup", marks=marks, id=f"{family}-fresh_warmup")


SEQ2SEQ_CASES = (("t5_copy", "finetune_full"), ("bart", "finetune_full"), ("bart", "fresh_warmup"))
"""Encoder-decoder runs beside the ``t5`` family, whose labels are their input ids (the model shifts them into its
decoder): T5 fine-tuned, BART fine-tuned and from scratch."""


@pytest.mark.parametrize("family, setting", list(cases()))
def test_the_pack_at_its_defaults_is_silent_on_a_healthy_run(tmp_path, family, setting):
    pack = run_case(tmp_path, family, setting)
    assert problems(pack) == []
    if setting == "val_split":  # BatchGuard compared the held-out rows with the training rows (TFD126 silent)
        [guard] = [c for c in pack if type(c).__name__ == "BatchGuard"]
        assert len(guard._leak.watch.loops["validation"]) > 0
    # the new detectors were there and stayed silent
    assert not {f.code for c in pack for f in c.findings} & {"TFD122", "TFD602"} or all(
        f.severity == "info" for c in pack for f in c.findings if f.code == "TFD602"
    )


@pytest.mark.slow
@pytest.mark.ddp
@pytest.mark.parametrize("family", ["tinygpt", "gpt2", "llama"])
def test_the_pack_at_its_defaults_is_silent_on_a_healthy_ddp_run(tmp_path, family):
    model_class = "tests.healthy_models:HealthyTinyGPT" if family == "tinygpt" else "tests.healthy_models:HFLM"
    spec = {
        "strategy": "ddp",
        "model_class": model_class,
        "model": {} if family == "tinygpt" else {"family": family},
        "data": {"batch_size": 8},
        "trainer": {"max_steps": STEPS[family], "log_every_n_steps": 10},
        "callbacks": [{"class_path": f"lightning_tfdebug.{name}"} for name in PACK_NAMES],
    }
    results = run_distributed(tmp_path, spec, timeout=600)
    for result in results:
        assert result["error"] is None, result["error"]
        assert result["global_step"] == STEPS[family]
        found = [f for findings in result["findings"].values() for f in findings]
        assert [f"{f['code']} {f['message']}" for f in found if f["severity"] in ("warning", "error")] == []
        path = os.environ.get("TFD_HEALTHY_REPORT")
        if path:
            with open(path, "a") as out:
                for f in found:
                    case = f"{family}/ddp-rank{result['rank']}"
                    out.write(json.dumps({"case": case, "code": f["code"], "severity": f["severity"]}) + "\n")


@pytest.mark.slow
@pytest.mark.parametrize("without_proc", [False, True], ids=["with-proc", "without-proc"])
def test_the_pack_is_silent_on_a_healthy_run_while_other_processes_keep_twice_the_cores_busy(
    tmp_path, monkeypatch, without_proc
):
    """Contention is not a regression: busy loops on twice the cores arrive at step 40, after ThroughputMonitor's
    early window, and stay to the end; the run itself does not change (issue 35)."""
    if without_proc:  # macOS: no run-queue waits, the reference computation alone tells
        import lightning_tfdebug.core.host as host

        monkeypatch.setattr(host, "thread_run_delays", lambda: None)
        monkeypatch.setattr(host, "thread_run_delay_ns", lambda: None)
    load = BusyLoops(at=40)
    pack = the_pack_at_defaults()
    trainer = make_trainer(tmp_path, [*pack, load], max_steps=STEPS["tinygpt"], log_every_n_steps=10)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", TFDebugWarning)
            trainer.fit(build("tinygpt"), data("tinygpt"))
    finally:
        load.stop()
    assert problems(pack) == []


# ------------------------------------------------------------------------------------- loss floors that do not bind
FLOOR_CASES = {
    "tinygpt-label_smoothing_0.1": ("tinygpt", lambda: SmoothedTinyGPT(0.1)),
    "gpt2-label_smoothing_0.1": ("gpt2", lambda: SmoothedHFLM("gpt2", 0.1)),
    "encoder_lm-label_smoothing_0.1": ("encoder_lm", lambda: SmoothedEncoderLM(0.1)),
    "gemma2-softcap_30": ("gemma", lambda: Gemma2LM(softcap=30.0)),
}
"""Issue 44's healthy counterparts: label smoothing 0.1 (named at info, its floor 16% of ln(V)) and Gemma 2's own
final-logit soft-cap of 30 in its forward (a floor of ~0), past the check."""


@pytest.mark.slow
@pytest.mark.parametrize("case", sorted(FLOOR_CASES))
def test_the_pack_is_silent_on_label_smoothing_and_a_soft_cap_that_bind_nothing(tmp_path, case):
    family, module = FLOOR_CASES[case]
    pack = the_pack_at_defaults()
    trainer = make_trainer(tmp_path, pack, max_steps=STEPS["tinygpt"], log_every_n_steps=10)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", TFDebugWarning)
        trainer.fit(module(), data(family))
    report(f"floors/{case}", pack)
    assert problems(pack) == []
    named = [f for c in pack for f in c.findings if f.code == "TFD237"]
    if "label_smoothing" in case:  # named, with its eps
        assert [f.severity for f in named] == ["info"] and "eps = 0.1" in named[0].message
    assert not [f for c in pack for f in c.findings if f.code == "TFD236"]
