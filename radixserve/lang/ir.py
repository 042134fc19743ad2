"""The expressions a program appends to its state: constant text, role markers, gen and select.

Expressions are plain values; they do nothing until ``s += expr`` hands them to the state's executor. ``+``
concatenates them (with strings too) into an ``ExprList``, which the executor runs left to right.
"""
from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from radixserve.lang.choices import ChoicesMethod
    from radixserve.lang.sampling import GenParams


class Expr:
    """Base of every expression: only adds ``+``. Subclasses are small frozen dataclasses."""

    __slots__ = ()

    def __add__(self, other: Expr | str) -> ExprList:
        return ExprList(tuple(leaves(self)) + tuple(leaves(as_expr(other))))

    def __radd__(self, other: Expr | str) -> ExprList:
        return ExprList(tuple(leaves(as_expr(other))) + tuple(leaves(self)))


@dataclass(frozen=True, slots=True, eq=False)
class Text(Expr):
    value: str


@dataclass(frozen=True, slots=True, eq=False)
class RoleBegin(Expr):
    role: str


@dataclass(frozen=True, slots=True, eq=False)
class RoleEnd(Expr):
    role: str


@dataclass(frozen=True, slots=True, eq=False)
class Gen(Expr):
    """Generate text into variable ``name`` (None: append it without keeping it)."""

    name: str | None
    params: GenParams


@dataclass(frozen=True, slots=True, eq=False)
class Select(Expr):
    """Append whichever of ``choices`` the model finds most likely, and keep it in variable ``name``."""

    name: str | None
    choices: tuple[str, ...]
    method: ChoicesMethod

    def __post_init__(self) -> None:
        if not self.choices:
            raise ValueError("select needs at least one choice, e.g. select('answer', choices=['yes', 'no'])")
        bad = [c for c in self.choices if not isinstance(c, str) or not c]
        if bad:
            raise ValueError(f"select choices must be non-empty strings; got {bad!r}")


@dataclass(frozen=True, slots=True, eq=False)
class ExprList(Expr):
    items: tuple[Expr, ...]


def as_expr(value: Expr | str) -> Expr:
    if isinstance(value, Expr):
        return value
    if isinstance(value, str):
        return Text(value)
    raise TypeError(f"a program can append strings and sgl expressions (gen, select, roles), not "
                    f"{type(value).__name__}; convert it with str(...) first")


def leaves(expr: Expr) -> Iterator[Expr]:
    """The expression flattened into the order the executor runs it."""
    if isinstance(expr, ExprList):
        for item in expr.items:
            yield from leaves(item)
    else:
        yield expr


def variable_names(expr: Expr) -> list[str]:
    """The variables running ``expr`` will set (so readers know to wait for them)."""
    return [e.name for e in leaves(expr) if isinstance(e, (Gen, Select)) and e.name is not None]
