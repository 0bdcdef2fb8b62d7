"""Lightning and model plumbing shared by the pack's callbacks (the GradScaler, a silent training step, compiled
models, imports named in a config, the model's vocabulary and context length). Nothing here measures or decides."""

from __future__ import annotations

import copy
import importlib
from collections.abc import Mapping
from typing import Any

import lightning.pytorch as pl
import torch
from torch import nn

from lightning_tfdebug.core.compat import is_lightning_instance
from lightning_tfdebug.functional.optimizers import replay_schedule


def grad_scaler_of(trainer: pl.Trainer) -> Any | None:
    """The precision plugin's GradScaler (fp16 AMP), or None."""
    return getattr(trainer.precision_plugin, "scaler", None)


def schedule_courses(trainer: pl.Trainer, pl_module: pl.LightningModule) -> list[Any]:
    """The course of each of the Trainer's LR schedulers from the current step to the end of the run, replayed on
    copies (:func:`~lightning_tfdebug.functional.optimizers.replay_schedule`; those that cannot be told left out)."""
    per_epoch = trainer.num_training_batches / max(1, trainer.accumulate_grad_batches)
    start, end = trainer.global_step, trainer.estimated_stepping_batches
    shared = (trainer, *pl_module.modules(), *pl_module.parameters())  # referenced by a copy, never copied
    courses = (replay_schedule(c, start, end, per_epoch, shared) for c in trainer.lr_scheduler_configs)
    return [course for course in courses if course is not None]


def import_object(path: str) -> Any:
    """Import ``"package.module:name"`` or ``"package.module.name"``."""
    module, sep, name = path.partition(":")
    if not sep:
        module, _, name = path.rpartition(".")
    if not module or not name:
        raise ValueError(f"expected an import path like 'package.module:function'; got {path!r}.")
    obj: Any = importlib.import_module(module)
    for part in name.split("."):
        obj = getattr(obj, part)
    return obj


def quiet_training_step(pl_module: pl.LightningModule, batch: Any, batch_idx: int) -> Any:
    """Call ``pl_module.training_step`` with ``self.log`` / ``self.log_dict`` silenced and the LR schedule restored
    afterwards (automatic optimization only; the caller sets ``no_grad``, the mode and the precision context)."""

    def _silent(*args: Any, **kwargs: Any) -> None:
        return None

    saved = {name: pl_module.__dict__[name] for name in ("log", "log_dict") if name in pl_module.__dict__}
    pl_module.__dict__["log"] = _silent
    pl_module.__dict__["log_dict"] = _silent
    schedules = _schedule_state(pl_module)
    try:
        return pl_module.training_step(batch, batch_idx)
    finally:
        for name in ("log", "log_dict"):
            pl_module.__dict__.pop(name, None)
        pl_module.__dict__.update(saved)
        _restore_schedule_state(schedules)


def _schedule_state(pl_module: pl.LightningModule) -> list[tuple[Any, dict[str, Any]]]:
    """The LR schedulers' states and the optimizers' param-group settings (host values), so that a replayed
    ``training_step`` that steps a scheduler by hand leaves the run's schedule where it was."""
    trainer = getattr(pl_module, "_trainer", None)
    if trainer is None:
        return []
    held: list[tuple[Any, dict[str, Any]]] = []
    for config in getattr(trainer, "lr_scheduler_configs", []) or []:
        scheduler = getattr(config, "scheduler", None)
        if callable(getattr(scheduler, "state_dict", None)):
            held.append((scheduler, copy.deepcopy(scheduler.state_dict())))
    for optimizer in getattr(trainer, "optimizers", []) or []:
        groups = [{k: v for k, v in group.items() if k != "params"} for group in optimizer.param_groups]
        held.append((optimizer, {"param_groups": copy.deepcopy(groups)}))
    return held


def _restore_schedule_state(held: list[tuple[Any, dict[str, Any]]]) -> None:
    for owner, state in held:
        if "param_groups" in state and isinstance(owner, torch.optim.Optimizer):
            for group, settings in zip(owner.param_groups, state["param_groups"]):
                for key, value in settings.items():
                    if isinstance(group.get(key), torch.Tensor) and isinstance(value, torch.Tensor):
                        group[key].copy_(value)  # in place: a capturable optimizer's graphs keep its tensor
                    elif group.get(key) is not value:
                        group[key] = value
        else:
            owner.load_state_dict(state)


def in_training_step(pl_module: nn.Module | None) -> bool:
    """Whether a forward runs inside the Trainer's ``training_step`` (Lightning's ``_current_fx_name``), and not in
    another callback's probe; where that attribute is missing, every forward counts."""
    name = getattr(pl_module, "_current_fx_name", None)
    return not isinstance(name, str) or name == "training_step"


def is_compiled(trainer: pl.Trainer, pl_module: pl.LightningModule) -> bool:
    """Whether ``torch.compile`` wraps the model or any submodule (hooks added afterwards may never run)."""
    if getattr(pl_module, "_compiler_ctx", None) is not None:  # trainer.fit(torch.compile(model))
        return True
    try:
        from torch._dynamo.eval_frame import OptimizedModule
    except ImportError:  # pragma: no cover
        return False
    roots = [pl_module]
    wrapped = getattr(trainer.strategy, "model", None)
    if isinstance(wrapped, nn.Module) and wrapped is not pl_module:
        roots.append(wrapped)
    for root in roots:
        for module in root.modules():
            if isinstance(module, OptimizedModule) or getattr(module, "_compiled_call_impl", None) is not None:
                return True
    return False


_CONTEXT_ATTRS = ("max_position_embeddings", "n_positions", "n_ctx", "max_seq_len", "seq_length")
_CONTEXT_HPARAMS = (
    "context_length",
    "max_seq_len",
    "max_seq_length",
    "max_position_embeddings",
    "n_positions",
    "n_ctx",
    "block_size",
    "seq_len",
    "max_length",
)
_POSITION_WORDS = ("pos", "wpe")  # position tables: `pos_emb`, `wpe`, `position_embeddings`, `pos_embed`
_TYPE_WORDS = ("type", "segment")  # token-type tables: `token_type_embeddings`, `segment_emb`


def _is_position_name(name: str) -> bool:
    leaf = name.rsplit(".", 1)[-1].lower()
    return any(w in leaf for w in _POSITION_WORDS)


def load_tokenizer(tokenizer: Any) -> Any:
    """An object with ``decode``: ``tokenizer`` itself, or what the import path ``"pkg.mod.Name"`` (or
    ``"pkg.mod:Name"``) names: a class or factory is called without arguments.

    Raises:
        ValueError: when the path cannot be imported or the result has no ``decode``.
    """
    if tokenizer is None:
        return None
    if isinstance(tokenizer, str):
        try:
            obj = import_object(tokenizer)
        except (ImportError, AttributeError, ValueError) as err:
            raise ValueError(f"`tokenizer` {tokenizer!r} is not an importable 'module.Name' path ({err}).") from err
        tokenizer = obj() if isinstance(obj, type) or (callable(obj) and not hasattr(obj, "decode")) else obj
    if not callable(getattr(tokenizer, "decode", None)):
        raise ValueError(f"`tokenizer` must have a `decode` method; got {type(tokenizer).__name__}.")
    return tokenizer


def find_vocab_size(model: nn.Module) -> tuple[int | None, str]:
    """The number of rows of the model's input embedding, and where it came from: ``get_input_embeddings()``, else
    an ``nn.Embedding`` as wide as an ``nn.Linear`` (the LM head), else the only one (never a position or token-type
    table). ``(None, reason)`` when none fits."""
    for name, module in model.named_modules():
        getter = getattr(module, "get_input_embeddings", None)
        if callable(getter) and not is_lightning_instance(module, "LightningModule"):
            try:
                emb = getter()
            except (NotImplementedError, AttributeError):
                continue
            if isinstance(emb, nn.Embedding):
                return emb.num_embeddings, f"{name or type(module).__name__}.get_input_embeddings()"
    # Position and token-type tables are never the vocabulary, even when their row count happens to equal a width.
    tokens = [
        (n, m)
        for n, m in model.named_modules()
        if isinstance(m, nn.Embedding) and not _is_position_name(n) and not any(w in n.lower() for w in _TYPE_WORDS)
    ]
    widths = {m.out_features for m in model.modules() if isinstance(m, nn.Linear)}
    for name, emb in tokens:
        if emb.num_embeddings in widths:
            return emb.num_embeddings, f"embedding '{name}' (rows equal the output head's width)"
    if len(tokens) == 1:  # a tied head applied with F.linear has no nn.Linear to match
        return tokens[0][1].num_embeddings, f"the only token embedding, '{tokens[0][0]}'"
    return None, "no input embedding found (no get_input_embeddings(), no embedding matching an output width)"


def find_context_length(model: nn.Module) -> tuple[int | None, str]:
    """The longest sequence the model accepts, and where it came from: a Hugging Face ``config``
    (``max_position_embeddings``, ``n_positions``), an ``nn.Embedding`` named like a position table
    (``pos``/``wpe``/``position``), a position parameter of shape ``(T, d)`` or ``(1, T, d)``, or the module's
    hyper-parameters (``context_length``, ``block_size``, ``max_seq_len`` ...)."""
    for name, module in model.named_modules():
        config = getattr(module, "config", None)
        if config is None or isinstance(config, Mapping):
            continue
        for attr in _CONTEXT_ATTRS:
            value = getattr(config, attr, None)
            if isinstance(value, int) and value > 0:
                return value, f"{name or type(module).__name__}.config.{attr}"
    for name, module in model.named_modules():
        if isinstance(module, nn.Embedding) and _is_position_name(name):
            return module.num_embeddings, f"position embedding '{name}'"
    for name, param in model.named_parameters():
        # a learned position table kept as a parameter: (T, d) or (1, T, d), added to the token embeddings
        if _is_position_name(name) and param.ndim in (2, 3) and (param.ndim == 2 or param.shape[0] == 1):
            return int(param.shape[-2]), f"position parameter '{name}' {tuple(param.shape)}"
    hparams = getattr(model, "hparams", None)
    if isinstance(hparams, Mapping):
        for attr in _CONTEXT_HPARAMS:
            value = hparams.get(attr)
            if isinstance(value, int) and value > 0:
                return value, f"hparams['{attr}']"
    return None, "no position table, config or context-length hyper-parameter found"
