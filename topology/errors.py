"""One-line user errors.

User mistakes (a bad file, an unknown name, an impossible value) are raised as ``ValueError`` (or a subclass)
with a message that names the file, the field path and the rule that was broken. The CLI prints that one line and
exits with status 2; anything else is a bug and keeps its traceback.

This module sits in ``topology`` because that package is the root of the dependency graph
(``topology`` <- ``engine.core`` <- ``sim`` / ``engine.real`` <- CLI): every layer may import it.
"""

from __future__ import annotations

from pathlib import Path

from pydantic import BaseModel, ValidationError, model_validator


class UserError(ValueError):
    """A mistake in user input; its message is one line and names what is wrong."""


def field_path(loc: tuple) -> str:
    """Render a pydantic error location ``('nodes', 3, 'gpus')`` as ``nodes[3].gpus``."""
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        else:
            out += ("." if out else "") + str(part)
    return out or "<root>"


def one_line(exc: BaseException, source: str | Path | None = None) -> str:
    """The one-line message for a user error, prefixed with its source file when known."""
    prefix = f"{source}: " if source else ""
    if isinstance(exc, ValidationError):
        errs = exc.errors()
        first = errs[0]
        msg = first.get("msg", "invalid value")
        if first.get("type") == "extra_forbidden":
            msg = "unknown key"
        more = f" (+{len(errs) - 1} more)" if len(errs) > 1 else ""
        return f"{prefix}{field_path(tuple(first.get('loc', ())))}: {msg}{more}"
    text = " ".join(str(exc).split()) or type(exc).__name__
    return f"{prefix}{text}"


def from_validation(exc: ValidationError, source: str | Path | None = None) -> UserError:
    """Turn a pydantic ValidationError into a one-line UserError (raise ... from exc)."""
    return UserError(one_line(exc, source))


def _admits_bool(annotation) -> bool:
    """Whether a field annotation (``bool``, ``bool | None``, ``Annotated[...]``, ``Any``) accepts a boolean."""
    from typing import Any, get_args

    if annotation is bool or annotation is Any:
        return True
    return any(_admits_bool(a) for a in get_args(annotation))


class NoBoolNumbers(BaseModel):
    """Base for spec models: a YAML ``true`` / ``false`` where a number belongs is an error (pydantic's lax mode
    reads ``tp: true`` as ``tp: 1`` and the run goes ahead with a value nobody wrote)."""

    @model_validator(mode="before")
    @classmethod
    def _no_bool_for_numbers(cls, data):
        if isinstance(data, dict):
            for key, v in data.items():
                if isinstance(v, bool) and key in cls.model_fields and not _admits_bool(cls.model_fields[key].annotation):
                    raise ValueError(f"{key}: expected a number or a name, got the boolean {str(v).lower()}")
        return data
