"""Plugins by name: every registry (eviction and schedule policies, routing policies, tool-call parsers, logit
processors) finds its entries here, in an entry-point group that a third-party package can add to; the built-ins
are registered the same way, in pyproject.toml. One lookup, so each registry says the same things the same way:
an unknown name lists the registered ones (and the nearest), a plugin that fails to import or build is named with
its own error, and one missing what its registry calls is refused before it is used.

    [project.entry-points."radixserve.eviction_policies"]
    my-policy = "my_package.module:MyPolicy"      # a class (or factory), called with the registry's arguments
"""
from __future__ import annotations

import inspect

from importlib.metadata import entry_points
from typing import Any

from radixserve.errors import did_you_mean


def registered(group: str) -> list[str]:
    """The names in ``group``, sorted."""
    return sorted({ep.name for ep in entry_points(group=group)})


def load_plugin(group: str, name: str, what: str, *args: Any, needs: tuple[str, ...] = (), see: str = "",
                offered: dict[str, Any] | None = None) -> Any:
    """The entry point ``name`` of ``group`` loaded and called with ``args``, and with those keyword arguments of
    ``offered`` its signature names (a plugin that takes none of them gets none). ValueError, naming ``what`` (e.g.
    "tool-call parser"): no such name (the registered ones listed); loading or building it raised (a plugin's own
    bug, with its error); the result has no attribute of ``needs`` (``see``: where the contract is written)."""
    matches = [ep for ep in entry_points(group=group) if ep.name == name]
    if not matches:
        names = registered(group)
        raise ValueError(f"unknown {what} {name!r}; available: {', '.join(names) or 'none'}"
                         f"{did_you_mean(name, names)}")
    ep = matches[0]
    try:
        factory = ep.load()
        kwargs = {}
        if offered:
            try:
                params = inspect.signature(factory).parameters
            except (TypeError, ValueError):  # a callable whose signature Python cannot read: it gets none
                params = {}
            kwargs = {k: v for k, v in offered.items() if k in params}
        plugin = factory(*args, **kwargs)
    except Exception as exc:  # a plugin's own bug: name it, keep the caller running
        raise ValueError(f"{what} {name!r} ({ep.value}) failed to load: {type(exc).__name__}: {exc}") from exc
    for attr in needs:
        if not hasattr(plugin, attr):
            raise ValueError(f"{what} {name!r} ({ep.value}) has no {attr!r}{f'; see {see}' if see else ''}")
    return plugin
