"""``addnorm train --set KEY=VALUE``: values read as Python literals, then checked against the field's annotation, so
a string never reaches a switch as a truthy value and ``nan`` never reaches a rate."""

from __future__ import annotations

import ast
import math
import types
import typing

__all__ = ["check_set_types", "parse_sets"]

_TRUE, _FALSE = {"true", "yes", "on"}, {"false", "no", "off"}


def _literal(text: str):
    low = text.strip().lower()
    if low in _TRUE:
        return True
    if low in _FALSE:
        return False
    if low in ("none", "null"):
        return None
    try:
        return ast.literal_eval(text)
    except (ValueError, SyntaxError):
        return text


def parse_sets(items: list[str] | None) -> dict:
    """``["a=1", "b=pre"]`` -> ``{"a": 1, "b": "pre"}``; an item without '=' is a ValueError naming it."""
    out = {}
    for item in items or []:
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise ValueError(f"--set expects key=value, got {item!r}")
        out[key.strip()] = _literal(value)
    return out


# inf means something only here (never stop a run early); everywhere else a non-finite number is a mistake
_INF_OK = {"diverge_factor"}
_WORDS = {bool: "true or false", int: "an integer", float: "a finite number", str: "a word", dict: "a {...} literal"}


def _kinds(hint) -> tuple:
    """The plain types an annotation allows: ``float | None`` -> (float, NoneType)."""
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        return tuple(t for arg in typing.get_args(hint) for t in _kinds(arg))
    return (typing.get_origin(hint) or hint,)


def check_set_types(sets: dict, hints: dict) -> dict:
    """``sets`` (from :func:`parse_sets`) with every value checked against its field's annotation in ``hints``:
    a bool field takes true/false only (not "nan", "x" or 1.5, which a dataclass keeps as truthy values), an int
    field an integer, a float field a finite number (an int is widened; nan, and inf outside ``_INF_OK``, are
    refused). A ValueError names the field, the value and what it must be."""
    checked = {}
    for key, value in sets.items():
        kinds = _kinds(hints[key])
        if value is None and type(None) in kinds:
            checked[key] = None
        elif isinstance(value, bool):  # before int: bool is an int subclass
            if bool not in kinds:
                raise ValueError(f"--set {key}={value!r}: {key} must be {_must(kinds)}")
            checked[key] = value
        elif isinstance(value, int) and int in kinds:
            checked[key] = value
        elif float in kinds and isinstance(value, (int, float, str)) and _number(value) is not None:
            number = _number(value)
            if math.isnan(number) or (math.isinf(number) and key not in _INF_OK):
                raise ValueError(f"--set {key}={value!r}: {key} must be a finite number")
            checked[key] = number
        elif isinstance(value, str) and str in kinds:
            checked[key] = value
        elif isinstance(value, dict) and dict in kinds:
            checked[key] = value
        else:
            raise ValueError(f"--set {key}={value!r}: {key} must be {_must(kinds)}")
    return checked


def _number(value) -> float | None:
    try:
        return float(value)
    except (TypeError, ValueError):
        return None


def _must(kinds: tuple) -> str:
    words = [_WORDS.get(k, getattr(k, "__name__", str(k))) for k in kinds if k is not type(None)]
    return " or ".join(words) + (" or None" if type(None) in kinds else "")
