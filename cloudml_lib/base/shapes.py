"""What a structured file the kit reads must hold, and the one way such a file is read: a regular file of
bounded size (base/files.py), parsed as JSON with Python's own limits (nesting depth, integer digits)
turned into a reason, then checked against its shape. A damaged file is never a traceback: `Damaged` says
what is wrong, and each caller decides what that means (a run file is named and skipped, a derived file is
rebuilt, a lock is judged stale).

The shapes say what the readers' users rely on (keys they index, types they compute with); keys a shape
does not name are allowed, so files of newer versions stay readable.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path

from cloudml_lib.base.errors import CloudMLError, shown
from cloudml_lib.base.files import read_text


class Damaged(ValueError):
    """A file whose content is not what it should be; the message says what is wrong."""


# ----------------------------------------------------------------------------- shapes, and their check


class Shape:
    """What a value must be; `problem` says what is wrong with `value` at `where`, or None."""

    def problem(self, value, where: str) -> str | None:
        raise NotImplementedError


@dataclass(frozen=True)
class Scalar(Shape):
    """A JSON scalar: "number" (finite), "any_number" (NaN and infinity too), "integer", "text", "bool"."""

    kind: str
    optional: bool = False

    def problem(self, value, where):
        if value is None:
            return None if self.optional else f"{where} is missing (null), expected {self.words()}"
        checks = {
            "number": lambda v: _is_number(v) and math.isfinite(v),
            "any_number": _is_number,
            "integer": lambda v: isinstance(v, int) and not isinstance(v, bool),
            "text": lambda v: isinstance(v, str),
            "bool": lambda v: isinstance(v, bool),
        }
        return None if checks[self.kind](value) else f"{where} is {shown(value)}, expected {self.words()}"

    def words(self) -> str:
        text = {"number": "a finite number", "any_number": "a number", "integer": "a whole number"}
        return text.get(self.kind, f"a {self.kind}") + (" or null" if self.optional else "")


@dataclass(frozen=True)
class OneOf(Shape):
    values: tuple

    def problem(self, value, where):
        if isinstance(value, str) and value in self.values:
            return None
        return f"{where} is {shown(value)}, expected one of {', '.join(self.values)}"


@dataclass(frozen=True)
class ListOf(Shape):
    item: Shape

    def problem(self, value, where):
        if not isinstance(value, list):
            return f"{where} is {kind_of(value)}, expected a list"
        return next((p for i, v in enumerate(value) if (p := self.item.problem(v, f"{where}[{i}]"))), None)


@dataclass(frozen=True)
class MapOf(Shape):
    """An object whose every value has one shape (flight name -> metrics), except the keys of `named`, each
    with a shape of its own (a summary's methods, and beside them one figure that is not a method's)."""

    value: Shape
    named: dict = field(default_factory=dict)

    def problem(self, value, where):
        if not isinstance(value, dict):
            return f"{where} is {kind_of(value)}, expected an object"
        return next(
            (
                p
                for k, v in value.items()
                if (p := self.named.get(k, self.value).problem(v, f"{where}.{k}" if where else str(k)))
            ),
            None,
        )


@dataclass(frozen=True)
class Obj(Shape):
    """An object with named fields (each optional unless in `required`); other keys are allowed."""

    fields: dict
    required: tuple = ()

    def problem(self, value, where):
        if not isinstance(value, dict):
            return f"{where or 'the file'} is {kind_of(value)}, expected an object"
        missing = [k for k in self.required if k not in value]
        if missing:
            return f"{where + ': ' if where else ''}no {', '.join(missing)}"
        for k, shape in self.fields.items():
            if k in value and (p := shape.problem(value[k], f"{where}.{k}" if where else k)):
                return p
        return None


@dataclass(frozen=True)
class Maybe(Shape):
    """`shape`, or null."""

    shape: Shape

    def problem(self, value, where):
        return None if value is None else self.shape.problem(value, where)


class Anything(Shape):
    def problem(self, value, where):
        return None


def _is_number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def kind_of(value) -> str:
    names = {dict: "an object", list: "a list", str: "text", bool: "true/false", type(None): "null"}
    return names.get(type(value), "a number" if _is_number(value) else type(value).__name__)


NUM, OPT_NUM, OPT_INT = Scalar("number"), Scalar("number", True), Scalar("integer", True)
INT, TEXT, OPT_TEXT, BOOL = Scalar("integer"), Scalar("text"), Scalar("text", True), Scalar("bool")
ANY = Anything()


# ------------------------------------------------------------------------------------------ reading


def parse_json(text: str | bytes, shape: Shape, where: str = ""):
    """`text` as JSON of `shape`; Damaged says why not (not JSON, a number over Python's digit limit,
    nesting too deep, the wrong shape, text no file can hold)."""
    try:
        doc = json.loads(text)
    except ValueError as e:  # a 5,000-digit integer too (Python's digit limit)
        raise Damaged(f"not JSON: {first_line(e)}") from None
    except RecursionError:
        raise Damaged("nested too deep to be a file CloudML wrote") from None
    problem = shape.problem(doc, where) or unicode_problem(doc)
    if problem:
        raise Damaged(problem)
    return doc


def read_json(path: str | Path, shape: Shape, limit: int):
    """A regular file of at most `limit` bytes (a symbolic link is not followed), parsed as JSON of
    `shape`. Damaged says what is wrong with its content; NotRegularFile (a FIFO, a folder) and OSError
    (missing, unreadable) pass through to the caller, who knows what the file is for."""
    try:
        text = read_text(path, limit=limit, follow=False)
    except CloudMLError as e:  # too big, not UTF-8
        raise Damaged(str(e)) from None
    return parse_json(text, shape)


def unicode_problem(doc) -> str | None:
    """Text no file can hold (a lone surrogate, which JSON's escapes and YAML's allow): it cannot be shown."""
    try:
        json.dumps(doc, ensure_ascii=False, default=str).encode("utf-8")
    except UnicodeEncodeError:
        return "it holds text that is not valid Unicode"
    except ValueError:  # nested too deep to write back
        return "nested too deep"
    return None


def first_line(e: Exception) -> str:
    return shown(str(e).splitlines()[0] if str(e) else type(e).__name__)
