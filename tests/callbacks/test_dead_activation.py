import warnings

import pytest
import torch
import torch.nn.functional as F
from lightning.pytorch import Callback
from lightning.pytorch.callbacks import ModelCheckpoint
from torch.utils.checkpoint import checkpoint

from lightning_tfdebug import DeadActivation
from lightning_tfdebug.demo import TinyGPT, TinyTextDataModule
from lightning_tfdebug.primitives.keys import declared
from tests.helpers import SMALL, make_trainer, read_csv_metrics, read_scalars, run_distributed
from tests.helpers import fit_tiny as fit

ACTS = ("blocks.0.mlp.act", "blocks.1.mlp.act")


def codes(callback):
    return [f.code for f in callback.findings]


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"dead_threshold": 0}, "dead_threshold"),
        ({"dead_threshold": 1.5}, "dead_threshold"),
        ({"saturation_threshold": 0}, "saturation_threshold"),
        ({"patience": 0}, "patience"),
        ({"dead_rise": 0}, "dead_rise"),
        ({"saturation_grad": 0.5}, "saturation_grad"),
        ({"saturation_rise": 0}, "saturation_rise"),
        ({"layers": "("}, "not a valid regular expression"),
        ({"preactivations": {}}, "non-empty mapping"),
        ({"preactivations": {"fc": "swoosh"}}, "must be one of"),
        ({"preactivations": {"(": "gelu"}}, "not a valid regular expression"),
        ({"every_n_steps": 0}, "every_n_steps"),
    ],
)
def test_bad_arguments_fail_at_construction(kwargs, match):
    with pytest.raises((ValueError, TypeError), match=match):
        DeadActivation(**kwargs)


def test_dead_relu_units_from_a_negative_bias_are_found_and_named(tmp_path):
    """Bug 14: a large negative bias before ReLU kills every unit (and they never come back)."""
    monitor = DeadActivation(every_n_steps=2)
    fit(tmp_path, [monitor], model=TinyGPT(activation="relu", mlp_bias_init=-5.0, **SMALL), max_steps=5)
    scalars = read_scalars(tmp_path / "tb" / "version_0")
    for act in ACTS:
        assert [s for s, _ in scalars[f"dead_activation/dead_frac/{act}"]] == [0, 2, 4]  # logged at the measured step
        assert all(v == 1.0 for _, v in scalars[f"dead_activation/dead_frac/{act}"])
        assert all(v == 1.0 for _, v in scalars[f"dead_activation/zero_frac/{act}"])
    [finding] = [f for f in monitor.findings if f.code == "TFD340"]
    assert finding.step == 2 and set(finding.evidence["dead_frac"]) == set(ACTS)
    assert "negative bias" in finding.hint and "GELU" in finding.hint
    rows = [
        r for r in read_csv_metrics(tmp_path / "csv" / "version_0") if r.get(f"dead_activation/dead_frac/{ACTS[0]}")
    ]
    assert [int(r["step"]) for r in rows] == [0, 2, 4]


def test_healthy_relu_and_gelu_runs_raise_nothing(tmp_path):
    relu = DeadActivation(every_n_steps=5)
    trainer = fit(tmp_path / "relu", [relu], model=TinyGPT(activation="relu", **SMALL), max_steps=21)
    assert codes(relu) == []
    zero = trainer.callback_metrics[f"dead_activation/zero_frac/{ACTS[0]}"].item()
    assert 0.2 < zero < 0.8  # ReLU is sparse by design: about half the outputs are zero
    assert trainer.callback_metrics[f"dead_activation/dead_frac/{ACTS[0]}"].item() < 0.1
    gelu = DeadActivation(every_n_steps=5)
    trainer = fit(tmp_path / "gelu", [gelu], max_steps=21)
    assert codes(gelu) == []
    assert trainer.callback_metrics[f"dead_activation/saturated_frac/{ACTS[0]}"].item() < 0.05
    logged = [k for k in trainer.callback_metrics if k.startswith("dead_activation/")]
    assert len(logged) == 6 and all(declared(DeadActivation.KEYS, k) for k in logged)  # every key is in KEYS


@pytest.mark.parametrize("activation", ["tanh", "sigmoid", "gelu"])
def test_saturation_is_found(tmp_path, activation):
    # a large bias pushes every pre-activation into the flat tail (+5 for tanh/sigmoid, -5 for GELU)
    bias = -5.0 if activation == "gelu" else 5.0
    monitor = DeadActivation(every_n_steps=1)
    model = TinyGPT(activation=activation, mlp_bias_init=bias, **SMALL)
    trainer = fit(tmp_path, [monitor], model=model, max_steps=2)
    assert trainer.callback_metrics[f"dead_activation/saturated_frac/{ACTS[0]}"].item() > 0.95
    [finding] = [f for f in monitor.findings if f.code == "TFD342"]
    assert set(finding.evidence["saturated_frac"]) == set(ACTS)
    if activation != "gelu":  # exact zeros mean nothing for tanh/sigmoid: no zero/dead keys
        assert f"dead_activation/zero_frac/{ACTS[0]}" not in trainer.callback_metrics


class GrowingBias(Callback):
    """Pushes the MLP biases further negative every step, as a too-high learning rate can."""

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        with torch.no_grad():
            for block in pl_module.blocks:
                block.mlp.fc.bias.sub_(0.15)


def test_a_rising_dead_fraction_is_reported(tmp_path):
    monitor = DeadActivation(every_n_steps=2, dead_threshold=0.99, dead_rise=0.25, patience=1)
    trainer = fit(tmp_path, [GrowingBias(), monitor], model=TinyGPT(activation="relu", **SMALL), max_steps=9)
    [finding] = [f for f in monitor.findings if f.code == "TFD341"]
    name = next(iter(finding.evidence["dead_frac"]))
    assert finding.evidence["dead_frac"][name] - finding.evidence["lowest"][name] >= 0.25
    assert trainer.callback_metrics[f"dead_activation/dead_frac/{name}"].item() > 0.25


class GrowingPositiveBias(Callback):
    """Pushes the MLP biases up every step, driving tanh further into its flat region."""

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        with torch.no_grad():
            for block in pl_module.blocks:
                block.mlp.fc.bias.add_(0.5)


def test_a_rising_saturated_fraction_is_reported(tmp_path):
    # saturation_threshold=1.0 can never be exceeded: only the rise can be reported
    monitor = DeadActivation(every_n_steps=2, saturation_threshold=1.0, saturation_rise=0.25, patience=1)
    model = TinyGPT(activation="tanh", **SMALL)
    trainer = fit(tmp_path, [GrowingPositiveBias(), monitor], model=model, max_steps=9)
    assert codes(monitor) == ["TFD344"]
    [finding] = monitor.findings
    name = next(iter(finding.evidence["saturated_frac"]))
    assert finding.evidence["lowest"][name] < 0.05 and finding.evidence["saturated_frac"][name] >= 0.25
    assert trainer.callback_metrics[f"dead_activation/saturated_frac/{name}"].item() > 0.25


class FunctionalGPT(TinyGPT):
    """The MLP applies its activation as a function, as many models do: no activation module to hook."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        for block in self.blocks:
            block.mlp.act = torch.nn.Identity()
            block.mlp.forward = lambda x, mlp=block.mlp: mlp.proj(F.relu(mlp.fc(x)))


def test_activations_called_as_functions_are_found_on_their_own(tmp_path):
    monitor = DeadActivation(every_n_steps=1)
    trainer = fit(tmp_path / "auto", [monitor], model=FunctionalGPT(mlp_bias_init=-5.0, **SMALL), max_steps=2)
    assert [layer.name for layer in monitor._hooks.layers] == ["blocks.0.mlp.relu()", "blocks.1.mlp.relu()"]
    assert trainer.callback_metrics["dead_activation/dead_frac/blocks.0.mlp.relu()"].item() == 1.0
    assert "TFD340" in codes(monitor)
    healthy = DeadActivation(every_n_steps=1)
    trainer = fit(tmp_path / "healthy", [healthy], model=FunctionalGPT(**SMALL), max_steps=2)
    assert 0.0 < trainer.callback_metrics["dead_activation/zero_frac/blocks.1.mlp.relu()"].item() < 0.9
    assert codes(healthy) == []


def _mode_depth_seen_by(modules):
    """Forward pre-hooks recording, per call, how many torch function modes are active (the measured forward's)."""
    seen = {name: [] for name in modules}
    for name, module in modules.items():
        module.register_forward_pre_hook(
            lambda m, args, name=name: seen[name].append(torch._C._len_torch_function_stack())
        )
    return seen


def test_own_computations_are_not_taken_for_activations_and_the_mode_is_dropped_after_discovery(tmp_path):
    """Activations as modules: the callback's own F.gelu (tail cut-off, preactivations) is not a layer of the model,
    so discovery finds no function-call layer and later measuring steps run the forward without the function mode."""
    model = TinyGPT(activation="gelu", **SMALL)
    seen = _mode_depth_seen_by({"root": model, "mlp": model.blocks[0].mlp})
    monitor = DeadActivation(every_n_steps=1, preactivations={r"blocks\.0\.mlp\.fc$": "gelu"})
    trainer = fit(tmp_path, [monitor], model=model, max_steps=3)
    assert [layer.name for layer in monitor._hooks.layers] == ["blocks.0.mlp.fc", *ACTS]
    assert not any(key.endswith("()") for key in trainer.callback_metrics)
    assert seen["root"][:3] == [1, 0, 0] and seen["mlp"][:3] == [1, 0, 0]  # the mode only at discovery (step 0)


def test_after_discovery_the_mode_runs_only_inside_modules_that_call_activation_functions(tmp_path):
    model = FunctionalGPT(**SMALL)
    block = model.blocks[0]
    seen = _mode_depth_seen_by({"attn": block.attn, "fc": block.mlp.fc, "ln_f": model.ln_f})
    monitor = DeadActivation(every_n_steps=1)
    trainer = fit(tmp_path, [monitor], model=model, max_steps=3)
    assert [layer.name for layer in monitor._hooks.layers] == ["blocks.0.mlp.relu()", "blocks.1.mlp.relu()"]
    assert seen["attn"][:3] == [1, 0, 0] and seen["ln_f"][:3] == [1, 0, 0]
    assert seen["fc"][:3] == [1, 1, 1]  # inside the caller (the MLP) on every measuring step
    assert 0.0 < trainer.callback_metrics["dead_activation/zero_frac/blocks.1.mlp.relu()"].item() < 0.9
    assert torch._C._len_torch_function_stack() == 0


def test_activations_called_as_functions_are_measured_through_preactivations(tmp_path):
    aside = DeadActivation(every_n_steps=1, functional=False)
    make_trainer(tmp_path / "a", [aside], max_steps=1).fit(
        FunctionalGPT(mlp_bias_init=-5.0, **SMALL), TinyTextDataModule(batch_size=8)
    )
    assert not aside.active
    assert aside.stood_aside["setting"] == "`preactivations`"
    monitor = DeadActivation(every_n_steps=1, preactivations={r"mlp\.fc$": "relu"}, functional=False)
    trainer = fit(tmp_path / "b", [monitor], model=FunctionalGPT(mlp_bias_init=-5.0, **SMALL), max_steps=2)
    assert trainer.callback_metrics["dead_activation/dead_frac/blocks.0.mlp.fc"].item() == 1.0
    assert "TFD340" in codes(monitor)


def test_a_model_without_any_activation_is_said_once(tmp_path):
    class Linear(TinyGPT):
        def __init__(self, **kwargs):
            super().__init__(**kwargs)
            for block in self.blocks:
                block.mlp.act = torch.nn.Identity()

    monitor = DeadActivation(every_n_steps=1)
    fit(tmp_path, [monitor], model=Linear(**SMALL), max_steps=3)
    assert [f.code for f in monitor.findings] == ["TFD343"]
    assert not monitor.active


def test_layers_regex_restricts_the_measured_modules(tmp_path):
    monitor = DeadActivation(every_n_steps=1, layers=r"blocks\.1\.")
    trainer = fit(tmp_path, [monitor], model=TinyGPT(activation="relu", **SMALL), max_steps=1)
    assert f"dead_activation/zero_frac/{ACTS[1]}" in trainer.callback_metrics
    assert f"dead_activation/zero_frac/{ACTS[0]}" not in trainer.callback_metrics


class CountingDeadActivation(DeadActivation):
    """Records how many times each hook fired on each measured step (a spy on the callback's own counters)."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.calls = []

    def _measure(self, trainer, pl_module, step):
        self.calls.append([layer.calls for layer in self._hooks.layers])
        super()._measure(trainer, pl_module, step)


class CheckpointedGPT(TinyGPT):
    """Runs each block under activation checkpointing: backward re-runs the blocks' forwards."""

    def __init__(self, use_reentrant=False, **kwargs):
        super().__init__(**kwargs)
        self.use_reentrant = use_reentrant

    def forward(self, input_ids, attention_mask=None):
        pos = torch.arange(input_ids.shape[1], device=input_ids.device)
        x = self.tok_emb(input_ids) + self.pos_emb(pos)
        for block in self.blocks:
            x = checkpoint(block, x, attention_mask, use_reentrant=self.use_reentrant)
        return self.head(self.ln_f(x))


@pytest.mark.parametrize("use_reentrant", [False, True])
def test_activation_checkpointing_is_not_double_counted(tmp_path, use_reentrant):
    plain, ckpt = CountingDeadActivation(every_n_steps=2), CountingDeadActivation(every_n_steps=2)
    torch.manual_seed(0)
    a = fit(tmp_path / "a", [plain], model=TinyGPT(activation="relu", **SMALL), max_steps=3)
    torch.manual_seed(0)
    model = CheckpointedGPT(use_reentrant=use_reentrant, activation="relu", **SMALL)
    b = fit(tmp_path / "b", [ckpt], model=model, max_steps=3)
    assert plain.calls == ckpt.calls == [[1, 1], [1, 1]]  # one forward call per layer per measured step
    for key in (f"dead_activation/zero_frac/{ACTS[0]}", f"dead_activation/dead_frac/{ACTS[1]}"):
        assert b.callback_metrics[key].item() == pytest.approx(a.callback_metrics[key].item(), abs=1e-6)


def test_hooks_exist_only_during_the_measured_forward(tmp_path):
    model = TinyGPT(activation="relu", **SMALL)
    acts = [b.mlp.act for b in model.blocks]
    seen = []

    class Probe(Callback):
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            seen.append(("start", trainer.global_step, sum(len(a._forward_hooks) for a in acts)))

        def on_before_backward(self, trainer, pl_module, loss):
            seen.append(("backward", trainer.global_step, sum(len(a._forward_hooks) for a in acts)))

    fit(tmp_path, [DeadActivation(every_n_steps=2), Probe()], model=model, max_steps=3)
    # the probe runs after DeadActivation: hooks are on at the start of a measured step, off before its backward
    assert seen == [
        ("start", 0, 2),
        ("backward", 0, 0),
        ("start", 1, 0),
        ("backward", 1, 0),
        ("start", 2, 2),
        ("backward", 2, 0),
    ]
    assert sum(len(a._forward_hooks) for a in acts) == 0


@pytest.mark.parametrize("how", ["wrapper", "in_place"])
def test_torch_compile_is_detected_and_said(tmp_path, how):
    monitor = DeadActivation(every_n_steps=1)
    model = TinyGPT(activation="relu", **SMALL)
    for i, block in enumerate(model.blocks):
        if how == "wrapper":  # an OptimizedModule in the tree: hooks added afterwards never run
            model.blocks[i] = torch.compile(block, backend="eager")
        else:  # nn.Module.compile(): the module's call is compiled in place
            block.compile(backend="eager")
    trainer = fit(tmp_path, [monitor], model=model, max_steps=2)
    [finding] = monitor.findings
    assert finding.code == "TFD343" and finding.evidence["compiled"] is True and "torch.compile" in finding.message
    assert not monitor.active and trainer.global_step == 2  # training went on
    assert not any(
        k.startswith(("dead_activation/zero_frac", "dead_activation/dead_frac")) for k in trainer.callback_metrics
    )
    assert all(len(m._forward_hooks) == 0 for m in model.modules())


class ProbeForward(Callback):
    """Another callback that runs the model on a slice of the batch from its own hook (as MaskProbe does)."""

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        with torch.no_grad():
            pl_module(batch["input_ids"][:2])


def test_forwards_of_other_callbacks_are_not_counted(tmp_path):
    monitor = CountingDeadActivation(every_n_steps=1)
    fit(tmp_path, [monitor, ProbeForward()], model=TinyGPT(activation="relu", **SMALL), max_steps=2)
    assert monitor.calls == [[1, 1], [1, 1]]


def test_gradient_accumulation_measures_the_first_micro_batch_once(tmp_path):
    monitor = CountingDeadActivation(every_n_steps=1)
    fit(tmp_path, [monitor], model=TinyGPT(activation="relu", **SMALL), max_steps=2, accumulate_grad_batches=3)
    assert monitor.calls == [[1, 1], [1, 1]]


def test_state_is_saved_and_restored_on_resume(tmp_path):
    first = DeadActivation(every_n_steps=1, dead_threshold=0.99, patience=3)
    ckpt = ModelCheckpoint(dirpath=tmp_path / "ckpt", save_last=True)
    model_kwargs = dict(activation="relu", mlp_bias_init=-5.0, **SMALL)
    fit(tmp_path, [first, ckpt], model=TinyGPT(**model_kwargs), max_steps=2, enable_checkpointing=True)
    assert first._history.dead_streak.counts == {ACTS[0]: 2, ACTS[1]: 2} and codes(first) == []
    resumed = DeadActivation(every_n_steps=1, dead_threshold=0.99, patience=3)
    trainer = make_trainer(tmp_path, [resumed], max_steps=3)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.fit(
            TinyGPT(**model_kwargs), TinyTextDataModule(batch_size=8), ckpt_path=str(tmp_path / "ckpt" / "last.ckpt")
        )
    assert resumed._history.lowest_dead == {ACTS[0]: 1.0, ACTS[1]: 1.0}
    [finding] = resumed.findings  # the third measurement in a row, counting the two before the checkpoint
    assert finding.code == "TFD340" and finding.step == 2


def test_built_from_lightning_cli_yaml(tmp_path):
    from lightning.pytorch.cli import LightningCLI

    config = tmp_path / "config.yaml"
    config.write_text(
        r"""
trainer:
  callbacks:
    - class_path: lightning_tfdebug.DeadActivation
      init_args:
        every_n_steps: 25
        dead_threshold: 0.3
        layers: "blocks\\."
        preactivations: {"mlp\\.fc$": gelu}
        on_finding: stop
"""
    )
    cli = LightningCLI(TinyGPT, TinyTextDataModule, run=False, args=["--config", str(config)])
    [monitor] = [c for c in cli.trainer.callbacks if isinstance(c, DeadActivation)]
    assert (monitor.every_n_steps, monitor.dead_threshold, monitor.on_finding) == (25, 0.3, "stop")
    assert monitor.layers == r"blocks\." and monitor.preactivations == {r"mlp\.fc$": "gelu"}


class RankBias(Callback):
    """Under DDP: half of block 0's MLP units are killed on rank 0 only, the other half on every rank."""

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        with torch.no_grad():
            bias = pl_module.blocks[0].mlp.fc.bias
            half = bias.numel() // 2
            bias[half:] = -5.0
            if trainer.global_rank == 0:
                bias[:half] = -5.0


@pytest.mark.ddp
def test_ddp_a_unit_is_dead_only_if_dead_on_every_rank(tmp_path):
    spec = {
        "strategy": "ddp",
        "model": {**SMALL, "activation": "relu"},
        "data": {"batch_size": 4},
        "trainer": {"max_steps": 1},
        "callbacks": [
            {"class_path": "tests.callbacks.test_dead_activation.RankBias"},
            {"class_path": "lightning_tfdebug.DeadActivation", "init_args": {"every_n_steps": 1, "patience": 1}},
        ],
    }
    results = run_distributed(tmp_path, spec)
    for r in results:
        assert r["error"] is None, r["error"]
        # rank 0 alone would see 100% dead; globally only the half dead on both ranks is
        assert r["metrics"][f"dead_activation/dead_frac/{ACTS[0]}"] == pytest.approx(0.5)
        assert r["metrics"][f"dead_activation/dead_frac/{ACTS[1]}"] < 0.1
        assert r["findings"]["DeadActivation"] == []
    ours = [
        {
            k: v
            for k, v in r["metrics"].items()
            if k.startswith(("dead_activation/zero_frac", "dead_activation/dead_frac"))
        }
        for r in results
    ]
    assert len(ours[0]) == 4 and ours[0] == ours[1]  # reduced values: the same on every rank


@pytest.mark.ddp
def test_fsdp2_measures_sharded_models_with_loss_at_init_alongside(tmp_path):
    """Under FSDP2 (``fully_shard`` per block), activations are whole on each rank: one reduction agrees on them.

    The MLPs call ``F.relu`` (no activation module): the function-call layers are found under FSDP2's hooks and
    agreed by both ranks at the first measurement.
    """
    spec = {
        "strategy": "fsdp2",
        "model_class": "tests.callbacks.test_dead_activation:FunctionalGPT",
        "model": {**SMALL, "activation": "relu", "mlp_bias_init": -5.0, "softmax_output": True},
        "data": {"batch_size": 4},
        "trainer": {"max_steps": 3},
        "callbacks": [
            {"class_path": "lightning_tfdebug.DeadActivation", "init_args": {"every_n_steps": 1, "patience": 2}},
            {"class_path": "lightning_tfdebug.LossAtInit", "init_args": {"check_step": None}},
        ],
    }
    results = run_distributed(tmp_path, spec)
    for r in results:
        assert r["error"] is None, r["error"]
        assert [(f["code"], f["step"]) for f in r["findings"]["DeadActivation"]] == [("TFD340", 1)]
        assert [f["code"] for f in r["findings"]["LossAtInit"]] == ["TFD220"]
        assert r["metrics"]["dead_activation/dead_frac/blocks.0.mlp.relu()"] == 1.0
    ours = [
        {
            k: v
            for k, v in r["metrics"].items()
            if k.startswith(("dead_activation/zero_frac", "dead_activation/dead_frac", "loss_at_init/"))
        }
        for r in results
    ]
    # 4 activation keys; observed, expected, recomputed, logit_std, supervised_frac and copy_rate at step 0; loss,
    # ln_vocab and unigram_entropy on LossAtInit's measuring steps
    assert len(ours[0]) == 4 + 6 + 3 and ours[0] == ours[1]  # reduced values: the same on every rank
