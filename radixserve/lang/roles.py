"""``s.system(...)`` / ``s.user(...)`` / ``s.assistant(...)`` for anything that takes ``+=``: the program state and
run_batch's prefix probe build turns the same way."""
from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from radixserve.lang.ir import Expr, ExprList, RoleBegin, RoleEnd, as_expr


class Roles:
    def _role(self, role: str, expr: Expr | str | None) -> Any:
        """With an expression: the whole turn. Without: a context manager, ``with s.user(): s += ...``."""
        if expr is not None:
            self += ExprList((RoleBegin(role), as_expr(expr), RoleEnd(role)))  # noqa: PLW0642 (__iadd__ mutates)
            return None
        return self._role_scope(role)

    @contextmanager
    def _role_scope(self, role: str) -> Iterator[None]:
        self += RoleBegin(role)  # noqa: PLW0642
        yield
        self += RoleEnd(role)  # noqa: PLW0642

    def system(self, expr: Expr | str | None = None) -> Any:
        return self._role("system", expr)

    def user(self, expr: Expr | str | None = None) -> Any:
        return self._role("user", expr)

    def assistant(self, expr: Expr | str | None = None) -> Any:
        return self._role("assistant", expr)
