"""The dependency picture, as a contract: imports only point down.

Every module of the package belongs to one layer (the longest name below that starts it); a module may import its
own group and anything in a lower layer, never a higher layer or another group of its own layer (groups in one
layer are independent of each other). Lazy imports inside functions count too: they are dependencies all the
same. The pure cores and the bottom layers must also load without torch.

    front door & client library   radixserve, __main__, launch_server, cli_args, engine, the lab's CLI | lang
    actor shells                   actors/*_actor, api, router server, launcher, nodes, prepare, server_args
    pure cores                     the scheduler and the policy lab | the tokenizer core and chat templates
    protocol                       wire/messages
    model                          model/
    kernels | cache                kernels/ | cache/
    policies                       policies/
    base                           wire/plans and codec, errors, plugins, sampling params, ...
"""
from __future__ import annotations

import ast
import subprocess
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

LAYERS: list[list[list[str]]] = [  # top first; each layer a list of independent groups of module names
    [["radixserve", "radixserve.__main__", "radixserve.launch_server", "radixserve.cli_args", "radixserve.engine",
      "radixserve.server_process", "radixserve.lab.cli", "radixserve.lab.live", "radixserve.lab.report"],
     ["radixserve.lang"]],
    [["radixserve.actors", "radixserve.lab.shadow_actor", "radixserve.prepare", "radixserve.server_args"]],
    [["radixserve.actors.scheduler", "radixserve.lab", "radixserve.actors.router.policies",
      "radixserve.actors.router.tree"],
     ["radixserve.actors.tokenizer", "radixserve.actors.jinja_templates", "radixserve.role_markers",
      "radixserve.marker_probe"]],
    [["radixserve.wire.messages"]],
    [["radixserve.model"]],
    [["radixserve.kernels"], ["radixserve.cache"]],
    [["radixserve.policies"]],
    [["radixserve.wire", "radixserve.errors", "radixserve.plugins", "radixserve.sampling_params",
      "radixserve.structured", "radixserve.stop_regex", "radixserve.logit_processors", "radixserve.cpu_budget",
      "radixserve.cpu_load", "radixserve.trusted_cache", "radixserve.prompts", "radixserve.tool_parsers"]],
]
# The actor shells that are not in radixserve.actors' own layer: the scheduler's process loop.
SHELLS = ["radixserve.actors.scheduler.actor"]
LAYERS[1][0] += SHELLS
# Modules that must load without torch (a process that only schedules or simulates never pays for it).
TORCH_FREE = ["radixserve.actors.scheduler", "radixserve.lab", "radixserve.wire", "radixserve.cache",
              "radixserve.policies", "radixserve.plugins", "radixserve.sampling_params"]


def modules() -> dict[str, Path]:
    """Every module of the package: name -> file, from pyproject.toml's package list and folders."""
    setup = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    folders = setup.get("package-dir", {})
    found = {}
    for package in setup["packages"]:
        parent = package.rsplit(".", 1)[0]
        folder = ROOT / folders[package] if package in folders else (
            ROOT / folders[parent] / package.rsplit(".", 1)[1] if parent in folders else ROOT / package.replace(".", "/"))
        for file in sorted(folder.glob("*.py")):
            found[package if file.stem == "__init__" else f"{package}.{file.stem}"] = file
    return found


def imports(name: str, file: Path) -> set[str]:
    """The package's modules ``name`` imports (the most specific name each import gives)."""
    package = name if file.stem == "__init__" else name.rsplit(".", 1)[0]
    out = set()
    for node in ast.walk(ast.parse(file.read_text())):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package.split(".")[: len(package.split(".")) - node.level + 1] + ([base] if base else []))
            out.update(f"{base}.{a.name}" for a in node.names)  # pkg.mod, or pkg where the name is not a module
    return {m for m in out if m == "radixserve" or m.startswith("radixserve.")}


def place(name: str) -> tuple[int, int] | None:
    """(layer, group) of a module: the longest contract entry that names it or a package above it (the bare
    ``radixserve`` names only the package itself)."""
    best, where = -1, None
    for i, layer in enumerate(LAYERS):
        for j, group in enumerate(layer):
            for entry in group:
                hit = name == entry or (entry != "radixserve" and name.startswith(entry + "."))
                if hit and len(entry) > best:
                    best, where = len(entry), (i, j)
    return where


def resolve(target: str, known: dict[str, Path]) -> str | None:
    """The module an import names: itself, or (``from mod import name``) the module that holds the name."""
    while target and target not in known:
        target = target.rpartition(".")[0]
    return target or None


def test_every_module_has_a_layer():
    missing = [name for name in modules() if place(name) is None]
    assert not missing, f"modules in no layer of the contract (add them to LAYERS): {missing}"


def violations(known: dict[str, Path]) -> list[str]:
    """Every import in ``known`` (name -> file) that points up or sideways."""
    wrong = []
    for name, file in known.items():
        here = place(name)
        for target in sorted(imports(name, file)):
            mod = resolve(target, known)
            there = place(mod) if mod is not None and mod != name else None
            if here is None or there is None:
                continue  # itself, or a module in no layer (test_every_module_has_a_layer)
            if there[0] < here[0]:
                wrong.append(f"{name} (layer {here[0]}) imports {mod} (higher: layer {there[0]})")
            elif there[0] == here[0] and there[1] != here[1]:
                wrong.append(f"{name} imports {mod}: another group of layer {here[0]} (groups are independent)")
    return wrong


def test_imports_only_point_down():
    wrong = violations(modules())
    assert not wrong, "imports that point up or sideways:\n" + "\n".join(wrong)


def test_the_contract_catches_upward_and_sideways_imports(tmp_path):
    """The checker itself: a lazy import of the scheduler in the model, and the client library importing the
    server's engine, are both found."""
    known = modules()
    runner = tmp_path / "runner.py"
    runner.write_text(known["radixserve.model.runner"].read_text()
                      + "\n\ndef _f():\n    from radixserve.actors.scheduler.scheduler import Scheduler\n")
    lang = tmp_path / "lang.py"
    lang.write_text("from radixserve import engine\n")
    wrong = violations({**known, "radixserve.model.runner": runner, "radixserve.lang.api": lang})
    assert len(wrong) == 2, wrong
    assert "radixserve.model.runner (layer 4) imports radixserve.actors.scheduler.scheduler" in wrong[0] + wrong[1]
    assert any("radixserve.lang.api imports radixserve.engine: another group" in w for w in wrong)


def test_the_cores_load_without_torch():
    names = [n for n in modules() if any(n == p or n.startswith(p + ".") for p in TORCH_FREE)]
    code = ("import importlib, sys\n"
            f"for n in {names!r}:\n    importlib.import_module(n)\n"
            "print(sorted(m for m in ('torch', 'transformers') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]", f"importing {TORCH_FREE} loaded {out.stdout.strip()}"
