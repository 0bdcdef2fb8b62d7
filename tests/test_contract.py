"""The contract every callback of the pack keeps, and the pack itself (issue 36, item 1).

One suite, parametrised over the rows of ``tests/contract_settings.py`` (one per member of
:data:`lightning_tfdebug.pack.MEMBERS`, and one for :class:`~lightning_tfdebug.TFDebug`):

* a bad argument (a wrong type, a number out of range, an unknown choice) raises at construction, naming it; the cases
  are derived from the constructor's signature, so a new argument is covered the day it is added;
* its checkpoint state survives a real save and resume: the resumed instance holds what the checkpoint holds;
* ``copy.deepcopy`` and ``pickle`` work on a fresh instance and on one after a fit (LightningCLI, spawn launchers);
* alone it finds the same (code, severity) set as inside ``TFDebug(preset="full")`` on its row's buggy tiny run;
* it says no warning and no error on a healthy tiny run, and its own code never fails there;
* it runs under the standalone ``pytorch_lightning`` package's Trainer;
* a batch it cannot read costs one recorded stand-aside at most, never a traceback, and the fit finishes;
* under 2-rank DDP every rank ends with the same findings (one run of the whole pack; every member on its own in one
  more run under ``-m slow``).

Fits are tiny (a dozen steps of a two-layer width-32 model) and shared between the checks through one module-scoped
cache. A callback's own tests hold only what is specific to it.
"""

from __future__ import annotations

import copy
import inspect
import json
import math
import pickle
import re
import types
import typing
import warnings
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
from lightning.pytorch import Callback
from lightning.pytorch.callbacks import ModelCheckpoint

from lightning_tfdebug import TFDebugWarning
from lightning_tfdebug.demo import TinyGPT, TinyTextDataModule
from lightning_tfdebug.pack import MEMBERS, TFDebug
from lightning_tfdebug.rules import RULES
from tests.contract_settings import (
    CLASSES,
    DDP_FIXTURE,
    FIXTURES,
    NEGATIVE_OK,
    ROWS,
    UNREADABLE,
    ZERO_OK,
    Fixture,
    build,
)
from tests.helpers import SMALL, fit_tiny, run_distributed

NAMES = [*MEMBERS, "TFDebug"]

pytestmark = [  # Lightning's notes on what these tiny runs do on purpose
    pytest.mark.filterwarnings("ignore:You're resuming from a checkpoint that ended before the epoch ended"),
    pytest.mark.filterwarnings("ignore:The dirpath has changed"),
    pytest.mark.filterwarnings("ignore:You have overridden `on_after_batch_transfer`"),
]


def xfail_for(name: str, check: str) -> list[pytest.MarkDecorator]:
    reason = ROWS[name].xfail.get(check) if name in ROWS else None
    return [pytest.mark.xfail(strict=True, reason=reason)] if reason else []


def per_row(check: str, names: list[str] = NAMES) -> list[Any]:
    """``names`` as parameters, each carrying its row's strict xfail for ``check`` (if any)."""
    return [pytest.param(n, id=n, marks=xfail_for(n, check)) for n in names]


def test_every_member_of_the_pack_has_a_row():
    """A new callback is covered by adding its row; one without a row fails here."""
    assert set(ROWS) == set(MEMBERS) | {"TFDebug"}, "add a row to tests/contract_settings.py for every member"
    for name, row in ROWS.items():
        assert row.fixture in FIXTURES, (name, row.fixture)
        assert set(row.kwargs) <= set(inspect.signature(CLASSES[name].__init__).parameters), name
        for code in row.expect:
            assert RULES[code].source == name, f"{name} expects {code}, which belongs to {RULES[code].source}"
        cases = CHECKS | {f"bad_argument:{argument}={shown(value)}" for argument, value in bad_arguments(name)}
        cases |= {f"unreadable:{batch}" for batch in UNREADABLE}
        unknown = set(row.xfail) - cases
        assert not unknown, f"{name}: xfail names no case of this suite: {unknown}"


# ------------------------------------------------------------------ bad arguments
WRONG_TYPE = object()  # no argument accepts an arbitrary object, except those typed Any (a row's `anything`)


def _kinds(cls: type, argument: str) -> set[Any]:
    """The simple types an argument's annotation admits: int, float, bool, str, None, 'literal', 'container'."""
    hint = typing.get_type_hints(cls.__init__).get(argument, Any)
    kinds: set[Any] = set()
    stack = [hint]
    while stack:
        h = stack.pop()
        origin = typing.get_origin(h)
        if origin in (typing.Union, types.UnionType):
            stack.extend(typing.get_args(h))
        elif origin is typing.Literal:
            kinds.add("literal")
        elif h is type(None):
            kinds.add(None)
        elif h is Any:
            kinds.add(Any)
        elif origin is not None or not isinstance(h, type) or h not in (int, float, bool, str):
            kinds.add("container")  # dicts, sequences, tuples, callables
        else:
            kinds.add(h)
    return kinds


def bad_values(name: str, argument: str) -> list[Any]:
    """The values of the wrong type or out of range for ``argument`` of row ``name``, from its annotation."""
    row, kinds = ROWS[name], _kinds(CLASSES[name], argument)
    if argument in row.anything or Any in kinds:
        return []
    values: list[Any] = [WRONG_TYPE]
    numeric = bool(kinds & {int, float}) and bool not in kinds
    negative_ok = row.negative_ok | NEGATIVE_OK
    if numeric and argument not in negative_ok:
        values.append(-1)
    if numeric and argument not in row.zero_ok | ZERO_OK | negative_ok:
        values.append(0)
    if numeric and str not in kinds:
        values.append("3")  # a number given as text (a YAML value quoted by mistake)
    if int in kinds and float not in kinds:
        values.append(2.5)
    if "literal" in kinds:
        values.append("no_such_choice")
    if bool in kinds:
        values.append("yes")
    if kinds - {None} == {str}:
        values.append(3)
    return values


def bad_arguments(name: str) -> list[tuple[str, Any]]:
    """Every ``(argument, bad value)`` of row ``name``: derived from the signature, then the row's own."""
    arguments = [a for a in inspect.signature(CLASSES[name].__init__).parameters if a != "self"]
    return [*((a, v) for a in arguments for v in bad_values(name, a)), *ROWS[name].bad]


def shown(value: Any) -> str:
    return "object" if value is WRONG_TYPE else repr(value)


def bad_cases() -> list[Any]:
    return [
        pytest.param(
            name,
            argument,
            value,
            id=f"{name}-{argument}={shown(value)}",
            marks=xfail_for(name, f"bad_argument:{argument}={shown(value)}"),
        )
        for name in NAMES
        for argument, value in bad_arguments(name)
    ]


@pytest.mark.parametrize("name, argument, value", bad_cases())
def test_a_bad_argument_raises_at_construction_naming_it(name, argument, value):
    """One sentence naming the argument; for a value derived from the signature, also the value given (a row's own
    bad values are containers whose message names the offending entry instead)."""
    with pytest.raises((TypeError, ValueError)) as info:
        CLASSES[name](**{argument: value})
    message = str(info.value)
    assert re.search(rf"\b{re.escape(argument)}\b", message), f"the message does not name `{argument}`: {message}"
    if (argument, value) not in ROWS[name].bad:
        given = "object at" if value is WRONG_TYPE else repr(value)
        assert given in message, f"the message does not show the value given ({given}): {message}"


@pytest.mark.parametrize("name", NAMES)
def test_every_argument_has_a_bad_value_or_is_declared_to_accept_anything(name):
    row = ROWS[name]
    for argument in inspect.signature(CLASSES[name].__init__).parameters:
        if argument == "self" or argument in row.anything:
            continue
        assert bad_values(name, argument), f"{name}.{argument} accepts anything: list it in the row's `anything`"
    for argument in row.zero_ok | row.negative_ok | row.anything:
        assert argument in inspect.signature(CLASSES[name].__init__).parameters, f"{name} has no argument {argument}"


# ------------------------------------------------------------------ tiny fits, shared between the checks
@dataclass
class Run:
    """One finished (or failed) tiny fit of one callback (or the pack)."""

    callback: Any
    trainer: Any
    error: BaseException | None
    root: Path
    fixture: Fixture

    @property
    def members(self) -> dict[str, Any]:
        """The callbacks of the pack that ran: the pack's members, or the one callback."""
        if isinstance(self.callback, TFDebug):
            return dict(self.callback.members)
        return {type(self.callback).__name__: self.callback}

    def findings(self, member: str | None = None) -> set[tuple[str, str]]:
        members = self.members if member is None else {member: self.members[member]}
        return {(f.code, f.severity) for m in members.values() for f in m.findings}

    def loud(self) -> list[str]:
        """Every warning and error finding, printed (a failing check shows them whole)."""
        return [f.format() for m in self.members.values() for f in m.findings if f.severity in ("warning", "error")]

    @property
    def checkpoint(self) -> Path:
        saved = sorted((self.root / "checkpoints").glob("*.ckpt"))
        assert saved, f"the fit saved no checkpoint under {self.root}"
        return saved[-1]

    def assert_ran_cleanly(self) -> None:
        """The fit ended as its fixture says, every callback's own code ran without failing."""
        expected = self.fixture.raises
        if expected is None:
            assert self.error is None, f"the fit raised {self.error!r}"
        else:
            assert isinstance(self.error, expected), f"the fit raised {self.error!r}, not {expected.__name__}"
        failed = {n: m.failure["error"] for n, m in self.members.items() if m.failure is not None}
        assert not failed, f"callbacks failed in their own code: {failed}"
        errors = list(self.root.rglob("callback-errors-rank*.txt"))
        assert not errors, errors[0].read_text()[-3000:]


class StateAtTrainStart(Callback):
    """Reads a callback's ``state_dict()`` at the start of training: after a resumed fit restored it."""

    def __init__(self, watched: Any) -> None:
        self.watched = watched
        self.state: Any = None

    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        self.state = self.watched.state_dict()


def fit(root: Path, callback: Any, fixture: Fixture, *, steps: int | None = None, **kwargs: Any) -> Run:
    """Fit ``fixture`` with ``callback`` and a ModelCheckpoint that saves at the fixture's last step."""
    saver = ModelCheckpoint(dirpath=root / "checkpoints", every_n_train_steps=fixture.steps, save_top_k=-1)
    extra = kwargs.pop("callbacks", [])
    error = None
    trainer = None
    torch.manual_seed(0)  # the same run whichever test makes it first
    try:
        trainer = fit_tiny(
            root,
            [callback, saver, *extra],
            fixture.model_class(**SMALL, **fixture.model),
            TinyTextDataModule(batch_size=8, **fixture.data),
            max_steps=steps or fixture.steps,
            log_every_n_steps=2,
            enable_checkpointing=True,
            **kwargs,
        )
    except Exception as err:  # the fixture's own bug ends the fit (asserted by `assert_ran_cleanly`)
        error = err
    return Run(callback, trainer, error, root, fixture)


class Runs:
    """Every fit of the module, made once: ``alone(name, fixture)`` and ``pack(fixture)``."""

    def __init__(self, factory: pytest.TempPathFactory) -> None:
        self.factory = factory
        self.done: dict[tuple[str, str], Run] = {}

    def alone(self, name: str, fixture: str) -> Run:
        key = (name, fixture)
        if key not in self.done:
            root = self.factory.mktemp(f"{name}-{fixture}")
            self.done[key] = fit(root, build(name), FIXTURES[fixture])
        return self.done[key]

    def pack(self, fixture: str) -> Run:
        return self.alone("TFDebug", fixture)


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Runs:
    return Runs(tmp_path_factory)


# ------------------------------------------------------------------ healthy, checkpoint, copies, pack
CHECKS = {"healthy", "resume", "copy_fresh", "copy_after_fit", "same_in_pack", "pytorch_lightning"}
"""The checks a row's ``xfail`` can name; also ``bad_argument:<argument>=<value>`` and ``unreadable:<batch>``."""


@pytest.mark.parametrize("name", per_row("healthy"))
def test_silent_on_a_healthy_run(runs, name):
    run = runs.alone(name, "healthy")
    run.assert_ran_cleanly()
    assert run.trainer.global_step == run.fixture.steps
    assert not run.loud(), "\n".join(run.loud())


def _plain(value: Any) -> Any:
    """A checkpoint state in plain, comparable values (tensors as lists, NaN as a string, tuples as lists)."""
    if isinstance(value, torch.Tensor):
        return _plain(value.tolist())
    if isinstance(value, Mapping):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (set, frozenset)):
        return sorted((_plain(v) for v in value), key=repr)
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if isinstance(value, float) and math.isnan(value):
        return "nan"
    return value


@pytest.mark.parametrize("name", per_row("resume"))
def test_state_round_trips_through_a_checkpoint_and_resume(runs, tmp_path, name):
    """Saved by a real ModelCheckpoint, resumed by a fresh instance: at the start of training the resumed callback
    holds exactly what the checkpoint holds, and the resumed fit trains on without a failure."""
    fixture = ROWS[name].fixture if FIXTURES[ROWS[name].fixture].resumable else "healthy"
    first = runs.alone(name, fixture)
    first.assert_ran_cleanly()
    checkpoint = torch.load(first.checkpoint, map_location="cpu", weights_only=False)
    saved = checkpoint["callbacks"].get(first.callback.state_key)
    assert saved is not None, f"no state under {first.callback.state_key!r}: {list(checkpoint['callbacks'])}"
    fresh = build(name)
    assert fresh.state_key == first.callback.state_key
    spy = StateAtTrainStart(fresh)
    resumed = fit(
        tmp_path,
        fresh,
        FIXTURES[fixture],
        steps=FIXTURES[fixture].steps + 4,
        callbacks=[spy],
        ckpt_path=str(first.checkpoint),
    )
    resumed.assert_ran_cleanly()
    assert resumed.trainer.global_step == FIXTURES[fixture].steps + 4
    assert _plain(spy.state) == _plain(saved)


def _copies_alike(callback: Any) -> None:
    for twin in (copy.deepcopy(callback), pickle.loads(pickle.dumps(callback))):
        assert type(twin) is type(callback)
        assert twin.state_key == callback.state_key
        assert _plain(twin.state_dict()) == _plain(callback.state_dict())


@pytest.mark.parametrize("name", per_row("copy_fresh"))
def test_deepcopy_and_pickle_a_fresh_callback(name):
    _copies_alike(build(name))


@pytest.mark.parametrize("name", per_row("copy_after_fit"))
def test_deepcopy_and_pickle_a_callback_after_a_fit(runs, name):
    run = runs.alone(name, ROWS[name].fixture)
    run.assert_ran_cleanly()
    _copies_alike(run.callback)


@pytest.mark.parametrize("name", per_row("same_in_pack", list(MEMBERS)))
def test_the_same_findings_alone_and_in_the_pack(runs, name):
    """On its row's buggy run, the callback alone and the same callback inside ``TFDebug(preset="full")`` reach the
    same (code, severity) set; on the healthy run (rows without a buggy one), the same info findings."""
    row = ROWS[name]
    alone, pack = runs.alone(name, row.fixture), runs.pack(row.fixture)
    alone.assert_ran_cleanly()
    pack.assert_ran_cleanly()
    found = alone.findings()
    assert row.expect <= {code for code, _ in found}, f"{name} alone on {row.fixture}: {sorted(found)}"
    assert pack.findings(name) == found, f"alone {sorted(found)}, in the pack {sorted(pack.findings(name))}"


# ------------------------------------------------------------------ the standalone pytorch_lightning package
def _under_pytorch_lightning(ptl: types.ModuleType) -> Any:
    """TinyGPT inside a ``pytorch_lightning.LightningModule`` (the demo model is a ``lightning.pytorch`` one)."""

    class TinyGPTUnderPTL(ptl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = TinyGPT(**SMALL)

        def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
            return self.net(input_ids, attention_mask)

        def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
            loss = self.net.loss(self(batch["input_ids"], batch["attention_mask"]), batch["labels"])
            self.log("train/loss", loss)
            return loss

        def configure_optimizers(self) -> Any:
            return self.net.configure_optimizers()

    return TinyGPTUnderPTL()


@pytest.mark.parametrize("name", per_row("pytorch_lightning"))
def test_runs_under_the_standalone_pytorch_lightning_trainer(tmp_path, name):
    ptl = pytest.importorskip("pytorch_lightning")
    from pytorch_lightning.loggers import CSVLogger

    callback = build(name)
    trainer = ptl.Trainer(
        accelerator="cpu",
        devices=1,
        max_steps=6,
        logger=CSVLogger(tmp_path, name="csv", version=0),
        callbacks=[callback],
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        log_every_n_steps=2,
        default_root_dir=tmp_path,
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", TFDebugWarning)
        trainer.fit(_under_pytorch_lightning(ptl), TinyTextDataModule(batch_size=8).train_dataloader())
    assert trainer.global_step == 6
    run = Run(callback, trainer, None, tmp_path, Fixture(steps=6))
    run.assert_ran_cleanly()
    assert not run.loud(), "\n".join(run.loud())


# ------------------------------------------------------------------ a batch it cannot read
def _stand_asides(root: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for p in root.rglob("stood-aside-rank*.jsonl") for line in p.read_text().splitlines()]


@pytest.mark.parametrize(
    "name, batch",
    [
        pytest.param(name, batch, id=f"{name}-{batch}", marks=xfail_for(name, f"unreadable:{batch}"))
        for name in NAMES
        for batch in UNREADABLE
    ],
)
def test_a_batch_it_cannot_read_is_one_stand_aside_at_most(tmp_path, name, batch):
    fixture = UNREADABLE[batch]
    run = fit(tmp_path, build(name), fixture)
    run.assert_ran_cleanly()
    assert run.trainer.global_step == fixture.steps
    records: dict[str, int] = {}
    for record in _stand_asides(tmp_path):
        source = record["check"].split(":")[0]
        records[source] = records.get(source, 0) + 1
    assert all(n <= 1 for n in records.values()), f"a callback recorded more than one stand-aside: {records}"
    assert not run.loud(), "\n".join(run.loud())


# ------------------------------------------------------------------ 2-rank DDP
def _class_path(name: str) -> dict[str, Any]:
    return {"class_path": f"{CLASSES[name].__module__}.{name}", "init_args": dict(ROWS[name].kwargs)}


@pytest.mark.parametrize(
    "callbacks",
    [
        pytest.param(["TFDebug"], id="the-pack", marks=pytest.mark.ddp),
        pytest.param(list(MEMBERS), id="every-member-on-its-own", marks=[pytest.mark.ddp, pytest.mark.slow]),
    ],
)
def test_every_rank_ends_with_the_same_findings_under_ddp(tmp_path, callbacks):
    """A 2-rank gloo run with four bugs (:data:`~tests.contract_settings.DDP_FIXTURE`), of the whole pack (each member
    as in its row; one collective per measuring step for all of them) or, under ``-m slow``, of every member on its
    own in one Trainer (each its own collectives): every callback reaches the same (code, severity) set on both ranks,
    none fails in its own code, and the bugs are found."""
    spec = {
        "strategy": "ddp",
        "callbacks": [_class_path(name) for name in callbacks],
        "model": {**SMALL, **DDP_FIXTURE.model},
        "data": {"batch_size": 8, **DDP_FIXTURE.data},
        "trainer": {"max_steps": DDP_FIXTURE.steps, "log_every_n_steps": 2},
        "extra": "tests.contract_settings:ddp_extra",
    }
    results = run_distributed(tmp_path, spec, timeout=240)
    per_rank = []
    for result in results:
        assert result["error"] is None, result["error"]["traceback"]
        assert result["global_step"] == DDP_FIXTURE.steps
        assert not result["extra"]["failed"], result["extra"]["failed"]
        by_member: dict[str, set[tuple[str, str]]] = {name: set() for name in MEMBERS}
        for findings in result["findings"].values():
            for finding in findings:
                by_member[finding["source"]].add((finding["code"], finding["severity"]))
        per_rank.append(by_member)
    for name in MEMBERS:
        assert per_rank[0][name] == per_rank[1][name], f"{name}: rank 0 {per_rank[0][name]}, rank 1 {per_rank[1][name]}"
    found = {code for by_member in per_rank for codes in by_member.values() for code, _ in codes}
    assert {"TFD312", "TFD320", "TFD201", "TFD115"} <= found, sorted(found)
    assert results[0]["extra"]["stood_aside"] == results[1]["extra"]["stood_aside"]
