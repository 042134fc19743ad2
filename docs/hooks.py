"""MkDocs hooks: the reference parts of the site are generated from the code and the committed results, never
hand-copied. A page holds a marker; the hook puts the generated text in its place:

    <!-- radixserve:flags serve -->   every flag of `radixserve serve` (also: compare, router), from the parser
    <!-- radixserve:routes -->        every HTTP route of the server, from the app's router, with its handler's
                                      docstring and a request and answer recorded from a running server
                                      (docs/api-examples.json, written by docs/record_examples.py)
    <!-- radixserve:figures -->       the latest figure of each bench stage, from benchmarks/results/*/results.json,
                                      with its machine and commit; marked stale when the code it measures changed

Anything missing (a route without a recorded example, an example of a route that is gone, an unknown marker) is
a warning, and `mkdocs build --strict` (make docs) fails on warnings.
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import logging
import re
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

log = logging.getLogger("mkdocs.plugins.radixserve")
MARKER = re.compile(r"<!-- radixserve:(\w+)\s*([\w-]*)\s*-->")
EXAMPLES = Path(__file__).with_name("api-examples.json")


def on_page_markdown(markdown: str, page, config, files) -> str:  # noqa: ANN001 (MkDocs' signature)
    def fill(m: re.Match) -> str:
        kind, arg = m.group(1), m.group(2)
        above = re.findall(r"^(#+) ", markdown[: m.start()], re.M)
        level = len(above[-1]) + 1 if above else 2  # generated headings nest under the marker's section
        if kind == "flags":
            return flags_reference(arg, level)
        if kind == "routes":
            return routes_reference(level)
        if kind == "figures":
            text, problems = _provenance().figures_markdown(ROOT)
            for problem in problems:
                log.warning("%s: %s", page.file.src_path, problem)
            return text
        log.warning("%s: unknown marker %r", page.file.src_path, m.group(0))
        return m.group(0)

    return MARKER.sub(fill, markdown)


def _provenance():
    """benchmarks/provenance.py (benchmarks/ is not a package; MkDocs restores sys.path after loading hooks)."""
    spec = importlib.util.spec_from_file_location("provenance", ROOT / "benchmarks" / "provenance.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# -- flags -----------------------------------------------------------------------------------------------------
def flags_reference(command: str, level: int = 3) -> str:
    from radixserve.__main__ import build_parser

    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    if command not in sub.choices:
        log.warning("flags: no command %r (there are %s)", command, ", ".join(sub.choices))
        return ""
    parser = sub.choices[command]
    out = [f"Generated from `radixserve {command}`'s argument parser (`radixserve {command} --help` says the same)."]
    for group in parser._action_groups:
        rows = [a for a in group._group_actions if a.option_strings and a.dest != "help"]
        if not rows:
            continue
        title = group.title if group.title not in ("options", "optional arguments") else "other"
        out += ["", f"{'#' * level} {title[0].upper() + title[1:]}", "", "| Flag | Value | Default | What it does |",
                "|---|---|---|---|"]
        for a in rows:
            out.append(f"| {' '.join(f'`{o}`' for o in a.option_strings)} | {_value(a)} | {_default(a)} | "
                       f"{_cell(_help(a))} |")
    return "\n".join(out) + "\n"


def _value(a: argparse.Action) -> str:
    if a.nargs == 0:
        return "switch"
    if a.choices:
        return " \\| ".join(f"`{c}`" for c in a.choices)
    if a.metavar:
        return f"`{a.metavar}`"
    return f"`{getattr(a.type, '__name__', 'str')}`" if a.type else "`str`"


def _default(a: argparse.Action) -> str:
    if a.default is None or a.default == argparse.SUPPRESS:
        return ""
    if a.nargs == 0:
        return "on" if a.default else "off"
    value = " ".join(map(str, a.default)) if isinstance(a.default, (list, tuple)) else str(a.default)
    return f"`{value}`" if value else '`""`'


def _help(a: argparse.Action) -> str:
    text = (a.help or "") % {"default": a.default, "prog": "radixserve"} if a.help else ""
    return re.sub(r"\s*\(default: [^()]*(\([^()]*\)[^()]*)*\)$", "", text)  # the Default column says it


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ").replace("<", "&lt;")


# -- routes ----------------------------------------------------------------------------------------------------
def app_routes() -> list[tuple[str, str, str]]:
    """(method, path, handler's docstring) of every route the server answers, in the order they are added."""
    from radixserve.actors.api.app import make_app
    from radixserve.actors.api.server import ApiServer
    from radixserve.actors.transport import Endpoints

    server = ApiServer(Endpoints(tempfile.mkdtemp()), {"model": "m", "started": 0, "context_length": 8})
    try:
        app = make_app(server)
        routes = []
        for route in app.router.routes():
            if route.method == "HEAD":
                continue
            info = route.resource.get_info() if route.resource is not None else {}
            path = info.get("path") or info.get("formatter") or ""
            doc = (getattr(route.handler, "__doc__", None) or "").strip()
            routes.append((route.method, path, doc))
        return routes
    finally:
        server.channel.close()


def routes_reference(level: int = 3) -> str:
    examples = json.loads(EXAMPLES.read_text()) if EXAMPLES.exists() else {"routes": {}}
    recorded = examples.get("routes", {})
    routes = app_routes()
    names = {f"{m} {p}" for m, p, _ in routes}
    for gone in sorted(set(recorded) - names):
        log.warning("routes: docs/api-examples.json has an example of %s, which the server no longer answers", gone)
    out = [f"Generated from the server's routes (`actors/api/app.py`); each example was sent to `radixserve serve` "
           f"with the bundled model by `python docs/record_examples.py` (commit {examples.get('commit', '?')}, "
           f"{examples.get('recorded', '?')}) and its answer recorded as it came (long values cut)."]
    for method, path, doc in routes:
        name = f"{method} {path}"
        out += ["", f"{'#' * level} `{name}`", ""]
        if doc:
            out += [re.sub(r"\s+", " ", doc.split("\n\n")[0]), ""]
        example = recorded.get(name)
        if example is None:
            log.warning("routes: no recorded example of %s: add one to docs/record_examples.py and run it", name)
            continue
        out += _example(method, example)
    return "\n".join(out) + "\n"


def _example(method: str, ex: dict) -> list[str]:
    request = f"curl -s{'' if method == 'GET' else ' -X ' + method} http://127.0.0.1:30000{ex['url']}"
    if ex.get("body") is not None:
        request += " \\\n  -H 'Content-Type: application/json' -d '" + json.dumps(ex["body"]) + "'"
    answer = ex["answer"] if isinstance(ex["answer"], str) else json.dumps(ex["answer"], indent=2)
    kind = "json" if not isinstance(ex["answer"], str) else "text"
    return ["```bash", request, "```", "", f"Answer (HTTP {ex['status']}):", "", f"```{kind}", answer, "```"]
