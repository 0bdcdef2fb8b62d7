import hashlib
import json
import pickle
import warnings

import pytest
import torch
import yaml
from lightning.pytorch.callbacks import Callback, ModelCheckpoint

from lightning_tfdebug import ReproCapture
from lightning_tfdebug.demo import TinyGPT, TinyTextDataModule
from lightning_tfdebug.repro import BundleError, load_bundle, replay, write_bundle
from tests.helpers import SMALL, run_distributed
from tests.helpers import fit_tiny as fit


def tfdebug_dir(tmp_path):
    return tmp_path / "tb" / "version_0" / "tfdebug"


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"max_state_mb": -1}, "max_state_mb"),
        ({"capture_rng": "yes"}, "capture_rng"),
        ({"copy_batch": "sometimes"}, "copy_batch"),
        ({"on_finding": "x"}, "on_finding"),
    ],
)
def test_bad_arguments_fail_at_construction(kwargs, match):
    with pytest.raises((ValueError, TypeError), match=match):
        ReproCapture(**kwargs)


def test_run_json_at_fit_start_and_nothing_else_on_a_healthy_run(tmp_path):
    capture = ReproCapture()
    fit(tmp_path, [capture], max_steps=3, accumulate_grad_batches=2)
    run = json.loads((tfdebug_dir(tmp_path) / "run.json").read_text())
    assert run["world_size"] == 1 and run["strategy"] == "SingleDeviceStrategy"
    assert run["precision"] == "32-true" and run["accumulate_grad_batches"] == 2
    assert run["model_class"] == "lightning_tfdebug.demo.model.TinyGPT" and run["hparams"]["d_model"] == 32
    assert run["datamodule_hparams"]["batch_size"] == 8
    assert {"python", "torch", "lightning", "numpy"} <= set(run["versions"])
    assert run["torch_initial_seed"] == torch.initial_seed()
    assert not (tfdebug_dir(tmp_path) / "repro").exists()
    assert capture.findings == [] and capture.bundles == []
    assert capture._batch is None  # no reference kept after the last batch


def test_a_crash_writes_a_complete_bundle_before_the_exception_propagates(tmp_path):
    capture = ReproCapture()

    class SeesBundleFirst(Callback):  # runs after ReproCapture's on_exception, before the exception reaches the user
        def on_exception(self, trainer, pl_module, exception):
            self.existed = (tfdebug_dir(tmp_path) / "repro" / "step3-rank0" / "bundle.json").exists()

    late = SeesBundleFirst()
    with pytest.raises(IndexError, match="index out of range in self"):
        fit(tmp_path, [capture, late], data=TinyTextDataModule(batch_size=8, long_batch_every=4), max_steps=8)
    assert late.existed
    path = tfdebug_dir(tmp_path) / "repro" / "step3-rank0"
    assert capture.bundles == [str(path)]
    assert sorted(p.name for p in path.iterdir()) == ["batch.pt", "bundle.json", "model.pt", "rng.pt", "training.pt"]
    assert not list(path.parent.glob(".tmp-*"))
    bundle = load_bundle(path)
    meta = bundle.meta
    assert (meta["step"], meta["batch_idx"], meta["epoch"], meta["rank"], meta["world_size"]) == (3, 3, 0, 0, 1)
    assert meta["exception"]["type"] == "builtins.IndexError"
    assert meta["exception"]["message"] == "index out of range in self"
    assert "pos_emb" in meta["exception"]["traceback"] or "embedding" in meta["exception"]["traceback"]
    assert bundle.batch["input_ids"].shape == (8, 72) and bundle.batch["input_ids"].dtype == torch.long
    assert set(bundle.rng) == {"python", "numpy", "torch"}
    assert meta["model_state"]["saved"] is True
    assert set(bundle.model_state) == set(TinyGPT(**SMALL).state_dict())
    (finding,) = capture.findings
    assert finding.code == "TFD130" and str(path) in finding.message and finding.step == 3


def test_model_state_as_of_the_failing_step(tmp_path):
    capture = ReproCapture()
    model = TinyGPT(**SMALL)
    with pytest.raises(IndexError):
        fit(tmp_path, [capture], model=model, data=TinyTextDataModule(batch_size=8, bad_token_every=3), max_steps=8)
    saved = load_bundle(capture.bundles[0]).model_state
    for name, value in model.state_dict().items():  # the forward failed, so no update happened after the capture
        torch.testing.assert_close(saved[name], value)
    assert not torch.equal(saved["head.weight"], TinyGPT(**SMALL).state_dict()["head.weight"])  # two steps trained


def test_above_the_size_limit_the_bundle_names_the_last_checkpoint(tmp_path):
    capture = ReproCapture(max_state_mb=0.01)
    ckpt = ModelCheckpoint(dirpath=tmp_path / "ckpt", save_last=True, every_n_train_steps=2)
    with pytest.raises(IndexError):
        fit(
            tmp_path,
            [capture, ckpt],
            data=TinyTextDataModule(batch_size=8, long_batch_every=4),
            max_steps=8,
            enable_checkpointing=True,
        )
    bundle = load_bundle(capture.bundles[0])
    assert bundle.model_state is None and "model.pt" not in bundle.meta["files"]
    assert "exceeds max_state_mb=0.01" in bundle.meta["model_state"]["reason"]
    assert bundle.meta["model_state"]["checkpoint"] == str((tmp_path / "ckpt" / "last.ckpt").resolve())


def test_bundles_are_never_overwritten(tmp_path):
    first = write_bundle(tmp_path, step=5, rank=0, meta={"exception": {"type": "a", "message": "1"}})
    second = write_bundle(tmp_path, step=5, rank=0, meta={"exception": {"type": "b", "message": "2"}})
    third = write_bundle(tmp_path, step=5, rank=0, meta={})
    assert [p.rsplit("/", 1)[-1] for p in (first, second, third)] == ["step5-rank0", "step5-rank0-1", "step5-rank0-2"]
    assert load_bundle(first).exception["message"] == "1"
    assert not list(tmp_path.glob(".tmp-*"))


class _Payload:
    def __reduce__(self):  # what a malicious pickle does on load
        import os

        return (os.system, ("touch PWNED",))


def _crashed_bundle(tmp_path):
    capture = ReproCapture(max_state_mb=0)
    with pytest.raises(IndexError):
        fit(tmp_path, [capture], data=TinyTextDataModule(batch_size=8, long_batch_every=2), max_steps=4)
    return tfdebug_dir(tmp_path) / "repro" / "step1-rank0"


def test_a_tampered_bundle_gives_a_clear_error_not_code_execution(tmp_path, monkeypatch):
    path = _crashed_bundle(tmp_path)
    monkeypatch.chdir(tmp_path)
    # 1. bytes changed: the checksum refuses
    original = (path / "batch.pt").read_bytes()
    (path / "batch.pt").write_bytes(original[:-10] + b"0123456789")
    with pytest.raises(BundleError, match="does not match the checksum"):
        load_bundle(path)
    # 2. a pickle that runs code, with the checksum forged to match: weights_only refuses, nothing runs
    evil = pickle.dumps({"input_ids": _Payload()})
    (path / "batch.pt").write_bytes(evil)
    meta = json.loads((path / "bundle.json").read_text())
    meta["files"]["batch.pt"] = hashlib.sha256(evil).hexdigest()
    (path / "bundle.json").write_text(json.dumps(meta))
    with pytest.raises(BundleError, match=r"Refusing to load .*batch\.pt"):
        load_bundle(path)
    assert not (tmp_path / "PWNED").exists()
    # 3. an unexpected file listed, broken JSON, no JSON
    meta["files"]["evil.pkl"] = "0"
    (path / "bundle.json").write_text(json.dumps(meta))
    with pytest.raises(BundleError, match="unexpected file"):
        load_bundle(path)
    (path / "bundle.json").write_text("{not json")
    with pytest.raises(BundleError, match="not valid JSON"):
        load_bundle(path)
    with pytest.raises(BundleError, match="not a repro bundle"):
        load_bundle(tmp_path)


def test_an_exception_outside_a_training_batch_gives_a_bundle_without_batch(tmp_path):
    class FailsInValidation(TinyGPT):
        def validation_step(self, batch, batch_idx):
            raise ValueError("validation broke")

    capture = ReproCapture(max_state_mb=0)
    with pytest.raises(ValueError, match="validation broke"):
        fit(
            tmp_path,
            [capture],
            model=FailsInValidation(**SMALL),
            max_steps=4,
            limit_val_batches=1,
            val_check_interval=2,
            num_sanity_val_steps=0,
        )
    bundle = load_bundle(capture.bundles[0])
    assert bundle.batch is None and bundle.meta["in_training_batch"] is False and bundle.meta["step"] == 2
    assert "no batch" in capture.findings[0].message
    with pytest.raises(BundleError, match="holds no batch"):
        replay(bundle, TinyGPT(**SMALL))


def test_a_bundle_that_cannot_be_written_never_masks_the_exception(tmp_path):
    repro = tfdebug_dir(tmp_path) / "repro"
    repro.parent.mkdir(parents=True)
    repro.write_text("a file where the repro directory should be")
    capture = ReproCapture(on_finding="raise")
    with pytest.raises(IndexError, match="index out of range"):
        fit(tmp_path, [capture], data=TinyTextDataModule(batch_size=8, bad_token_every=2), max_steps=4)
    assert [f.code for f in capture.findings] == ["TFD131"]
    assert capture.bundles == []


def test_built_from_lightning_cli_yaml():
    from jsonargparse import ArgumentParser

    config = yaml.safe_load(
        """
        callbacks:
          - class_path: lightning_tfdebug.ReproCapture
            init_args:
              max_state_mb: 64
              capture_rng: false
        """
    )
    parser = ArgumentParser()
    parser.add_argument("--callbacks", type=list[Callback])
    capture = parser.instantiate_classes(parser.parse_object(config)).callbacks[0]
    assert isinstance(capture, ReproCapture) and capture.max_state_mb == 64 and capture.capture_rng is False


def test_state_keeps_the_bundle_list(tmp_path):
    capture = ReproCapture()
    capture.bundles = ["/x/step3-rank0"]
    restored = ReproCapture()
    restored.load_state_dict(capture.state_dict())
    assert restored.bundles == ["/x/step3-rank0"]


@pytest.mark.ddp
def test_ddp_every_rank_writes_its_own_bundle_and_each_replays(tmp_path):
    results = run_distributed(
        tmp_path,
        {
            "strategy": "ddp",
            "model": SMALL,
            "data": {"batch_size": 4, "bad_token_every": 3},
            "trainer": {"max_steps": 6},
            "callbacks": [{"class_path": "lightning_tfdebug.ReproCapture"}],
        },
    )
    assert [r["error"]["type"] for r in results] == ["IndexError", "IndexError"]
    repro = tmp_path / "tb" / "version_0" / "tfdebug" / "repro"
    assert sorted(p.name for p in repro.iterdir()) == ["step2-rank0", "step2-rank1"]
    for rank in (0, 1):
        bundle = load_bundle(repro / f"step2-rank{rank}")
        assert bundle.meta["world_size"] == 2 and bundle.meta["run"]["strategy"] == "DDPStrategy"
        assert [f["code"] for f in results[rank]["findings"]["ReproCapture"]] == ["TFD130"]
    # the two ranks saw different batches (distributed sampler), and rank 1's failure replays in one process
    b0, b1 = (load_bundle(repro / f"step2-rank{r}").batch["input_ids"] for r in (0, 1))
    assert not torch.equal(b0, b1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        result = replay(repro / "step2-rank1", TinyGPT(**SMALL))
    assert result.reproduced, result.traceback


class EditsBatchThenFails(TinyGPT):
    """Writes into its batch in place (as some training steps do), then fails at step 2."""

    def training_step(self, batch, batch_idx):
        batch["input_ids"][0, 0] = 7
        if self.trainer.global_step == 2:
            raise RuntimeError(f"first id seen {batch['input_ids'][0, 0].item()} / {batch['input_ids'].sum().item()}")
        return super().training_step(batch, batch_idx)


@pytest.mark.parametrize("copy_batch, original", [("always", True), ("never", False), ("auto", False)])
def test_copy_batch_keeps_the_batch_as_it_arrived(tmp_path, copy_batch, original):
    capture = ReproCapture(copy_batch=copy_batch, max_state_mb=0)
    seen = []

    class Record(Callback):  # runs after ReproCapture (which moves itself first), before training_step
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            seen.append(int(batch["input_ids"][0, 0]))

    with pytest.raises(RuntimeError, match="first id seen 7"):
        fit(tmp_path, [Record(), capture], model=EditsBatchThenFails(**SMALL), max_steps=4)
    saved = load_bundle(capture.bundles[0]).batch["input_ids"][0, 0].item()
    assert seen[-1] != 7  # the demo data start with BOS 257
    assert saved == (seen[-1] if original else 7)
    if original:  # the copy replays exactly: the step edits it again and fails with the same message
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            assert replay(capture.bundles[0], EditsBatchThenFails(**SMALL), load_state=False).reproduced


def test_a_batch_that_cannot_reach_the_host_still_gives_a_bundle_that_says_so(tmp_path):
    unreadable = {"input_ids": torch.empty(2, 3, device="meta")}  # copying a meta tensor fails, as CUDA does after
    path = write_bundle(  # a device-side assert
        tmp_path,
        step=4,
        rank=0,
        meta={"exception": {"type": "builtins.RuntimeError", "message": "x"}},
        batch=unreadable,
        model_state={"w": torch.empty(3, device="meta")},
    )
    bundle = load_bundle(path)
    assert bundle.batch is None and bundle.model_state is None
    assert "could not be copied to the host" in bundle.meta["batch_error"]
    assert "could not be copied" in bundle.meta["model_state"]["reason"]
    with pytest.raises(BundleError, match=r"holds no batch \(the batch could not be copied"):
        replay(bundle, TinyGPT(**SMALL))


@pytest.mark.gpu
def test_cuda_batches_are_copied_to_pinned_host_memory_and_replay_on_the_cpu(tmp_path):
    capture = ReproCapture()
    with pytest.raises(RuntimeError, match="first id seen 7"):
        fit(tmp_path, [capture], model=EditsBatchThenFails(**SMALL), max_steps=4, accelerator="gpu")
    bundle = load_bundle(capture.bundles[0])
    assert bundle.batch["input_ids"].device.type == "cpu" and bundle.batch["input_ids"][0, 0].item() != 7
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert replay(bundle, EditsBatchThenFails(**SMALL), accelerator="cpu").reproduced


def test_an_exception_in_a_later_batch_end_hook_keeps_that_steps_batch(tmp_path):
    class FailsAfterStep(Callback):  # like a NaN check raising in on_train_batch_end
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            if batch_idx == 2:
                self.ids = batch["input_ids"].clone()
                raise RuntimeError("raised after the step")

    late = FailsAfterStep()
    capture = ReproCapture(max_state_mb=0)
    with pytest.raises(RuntimeError, match="after the step"):
        fit(tmp_path, [late, capture], max_steps=6)
    bundle = load_bundle(capture.bundles[0])
    assert bundle.meta["in_training_batch"] and bundle.meta["after_step"] and bundle.meta["batch_idx"] == 2
    assert torch.equal(bundle.batch["input_ids"], late.ids)
    assert "after that step's training_step" in capture.findings[0].message


@pytest.mark.parametrize("copy_batch, shared", [("always", True), ("auto", False)])
def test_the_host_copy_is_shared_for_other_callbacks_to_read_after_a_device_failure(tmp_path, copy_batch, shared):
    from lightning_tfdebug.repro import shared_host_copy

    copies = []

    class Read(Callback):  # runs after ReproCapture, as BatchGuard does
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            copies.append((batch, shared_host_copy(trainer, batch)))

    fit(tmp_path, [Read(), ReproCapture(copy_batch=copy_batch)], max_steps=3)
    if shared:  # a copy of each step's own batch, not a reference to it
        assert all(c is not None and c is not b and torch.equal(c["input_ids"], b["input_ids"]) for b, c in copies)
    else:  # CPU batches are kept by reference: nothing to share, the batch itself stays readable
        assert [c for _, c in copies] == [None, None, None]


class DrawsFromPython(TinyGPT):
    def training_step(self, batch, batch_idx):
        import random

        random.random()
        return super().training_step(batch, batch_idx)


def test_python_and_numpy_generators_are_captured_only_once_a_step_draws_from_them(tmp_path):
    plain = ReproCapture()
    fit(tmp_path / "plain", [plain], max_steps=6, log_every_n_steps=10)
    assert plain._host_rng_used is False and plain._probed == 4  # the first four batches; steps 4, 5 do not measure
    drawing = ReproCapture()
    fit(tmp_path / "draws", [drawing], model=DrawsFromPython(**SMALL), max_steps=6, log_every_n_steps=10)
    assert drawing._host_rng_used is True and drawing.state_dict()["host_rng_used"] is True
