"""Bad input, everywhere: every public constructor (every callback and the one-entry pack) gets a value of the wrong
type for every typed argument, and every numeric argument a value out of any sane range, and must answer with one
clear message naming the argument and what was given (issue 16, item 7).

Built from the constructors' own signatures, so a new argument is covered the day it is added."""

from __future__ import annotations

import inspect
import types
import typing

import pytest

import lightning_tfdebug
from lightning_tfdebug.core.base import DebugCallback


def public_constructors() -> list[type]:
    classes = [getattr(lightning_tfdebug, n) for n in lightning_tfdebug.__all__]
    found = [c for c in classes if isinstance(c, type) and issubclass(c, DebugCallback) and c is not DebugCallback]
    try:
        from lightning_tfdebug.pack import TFDebug

        found.append(TFDebug)
    except ImportError:  # pragma: no cover - the pack is part of the package
        pass
    return found


WRONG_TYPE = object()  # no argument of the pack accepts an arbitrary object, except those typed Any


def _kinds(cls: type, name: str) -> set[type]:
    hints = typing.get_type_hints(cls.__init__)
    hint = hints.get(name, typing.Any)
    out: set[type] = set()
    stack = [hint]
    while stack:
        h = stack.pop()
        origin = typing.get_origin(h)
        if origin in (typing.Union, types.UnionType):
            stack.extend(typing.get_args(h))
        elif origin is typing.Literal:
            out.add(typing.Literal)
        elif h is typing.Any or origin is not None:
            out.add(object)  # containers, callables, Any: not a simple type
        elif isinstance(h, type):
            out.add(h)
    return out


def cases() -> list[tuple[type, str, object]]:
    rows = []
    for cls in public_constructors():
        for name, param in inspect.signature(cls.__init__).parameters.items():
            if name == "self" or param.kind in (param.VAR_KEYWORD, param.VAR_POSITIONAL):
                continue
            kinds = _kinds(cls, name)
            if object in kinds or not kinds:
                continue  # Any, callables, mappings: checked by their own tests
            rows.append((cls, name, WRONG_TYPE))
            if kinds & {int, float} and bool not in kinds:
                rows.append((cls, name, -(10**9)))  # out of range for every count, rate, size and threshold
    return rows


def _id(row) -> str:
    cls, name, value = row
    return f"{cls.__name__}-{name}-{'object' if value is WRONG_TYPE else value}"


@pytest.mark.parametrize("row", cases(), ids=_id)
def test_every_constructor_names_the_argument_and_the_value(row):
    cls, name, value = row
    if value is not WRONG_TYPE and name in {"ignore_index", "input_key", "mask_key", "labels_key"}:
        pytest.skip(f"{name}: any integer is a valid value")
    with pytest.raises((TypeError, ValueError)) as info:
        cls(**{name: value})
    message = str(info.value)
    assert f"`{name}`" in message or name in message, message
    shown = repr(value) if value is not WRONG_TYPE else "object at"
    assert shown in message, message
    assert "must" in message or "one of" in message, message


def test_the_table_covers_every_constructor():
    names = {cls.__name__ for cls, _, _ in cases()}
    assert {c.__name__ for c in public_constructors()} <= names
    assert "TFDebug" in names and len(names) >= 14
