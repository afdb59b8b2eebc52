"""The import layers, as folders: each package may import only the layers below it, and no module
or package imports itself back through another.

Every import statement is read from the source (AST), at the top, inside a function or under
TYPE_CHECKING alike, so a new import is checked when it is added. The layers, lowest first:

- `tangram_runner`: the program that runs inside sandboxes; the standard library only.
- `scheduler` (core): the pure scheduling code (model, resources, queue, policies, round); it
  imports nothing of ours.
- `tangram_celery.common` (the floor): errors, actions, wire, records, config, admission.
- `tangram_celery.store` (Redis keys, scripts, operations), `tangram_celery.transport` (the Celery
  app, the embedded broker), `tangram_celery.sandbox` (the sandbox backends), `reward_servers`
  (Triton, the reward backends) and `scheduler.sim` (the simulator) stand on the floor and core.
- `tangram_celery.client` (both clients), then `tangram_celery.integrations`, `tangram_celery.web`.
- `tangram_celery.workers` and `scheduler.service` (the processes that act).
- the roof: `tangram_celery.deploy` and the top-level modules of `tangram_celery` (cli, demo,
  report, testing, the facade), which may import anything.
"""

from __future__ import annotations

import ast
import functools
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("tangram_runner", "scheduler", "tangram_celery", "reward_servers")

CORE = "scheduler"
COMMON = "tangram_celery.common"
STORE = "tangram_celery.store"
TRANSPORT = "tangram_celery.transport"
SANDBOX = "tangram_celery.sandbox"
CLIENT = "tangram_celery.client"
BASE = {CORE, COMMON}

# layer -> the layers it may import (besides itself). A layer not listed here is a new folder
# that must be given its place before it can be imported.
ALLOWED: dict[str, set[str]] = {
    "tangram_runner": set(),
    CORE: set(),
    COMMON: {CORE},
    STORE: BASE,
    TRANSPORT: BASE | {STORE},
    SANDBOX: BASE | {"tangram_runner"},
    "tangram_celery.apis": BASE,
    "reward_servers": BASE,
    "scheduler.sim": BASE,
    CLIENT: BASE | {STORE, TRANSPORT},
    "tangram_celery.integrations": BASE | {STORE, TRANSPORT, CLIENT},
    "tangram_celery.web": BASE | {STORE, TRANSPORT, CLIENT, "tangram_celery.integrations"},
    "tangram_celery.workers": BASE
    | {STORE, TRANSPORT, SANDBOX, "tangram_runner", "reward_servers", "tangram_celery.apis"},
    "scheduler.service": BASE | {STORE, TRANSPORT, "reward_servers"},
    "tangram_celery.swe": BASE | {STORE, TRANSPORT, CLIENT, SANDBOX},
}
ROOF = {"tangram_celery.deploy", "tangram_celery"}  # may import anything


def modules() -> dict[str, Path]:
    """Every module of our packages: dotted name -> file."""
    out = {}
    for pkg in PACKAGES:
        for path in (ROOT / pkg).rglob("*.py"):
            parts = list(path.relative_to(ROOT).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            out[".".join(parts)] = path
    return out


def imports(name: str, path: Path, known: set[str]) -> set[str]:
    """The modules of `known` that `name` imports anywhere in its source (itself excluded)."""
    tree = ast.parse(path.read_text(), str(path))
    pkg = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = pkg.split(".")[: len(pkg.split(".")) - node.level + 1]
                base = ".".join([*up, base] if base else up)
            targets = [base] + [f"{base}.{a.name}" for a in node.names]
        else:
            continue
        for t in targets:
            while t and t not in known:
                t = t.rpartition(".")[0]
            if t and t != name:
                out.add(t)
    return out


@functools.cache
def graph() -> dict[str, set[str]]:
    mods = modules()
    known = set(mods)
    return {name: imports(name, path, known) for name, path in mods.items()}


def layer_of(module: str) -> str:
    """The layer (a folder) a module belongs to: the deepest listed folder that holds it."""
    best = ""
    for group in (*ALLOWED, *ROOF):
        if (module == group or module.startswith(group + ".")) and len(group) > len(best):
            best = group
    return best


def cycles(g: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one node (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(g.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                found.append(sorted(comp))

    for v in sorted(g):
        if v not in index:
            visit(v)
    return found


def package_of(module: str) -> str:
    """The folder (package) of a module: a package's __init__ counts as its own folder."""
    is_pkg = (ROOT / module.replace(".", "/") / "__init__.py").exists()
    return module if is_pkg else module.rpartition(".")[0] or module


def test_every_module_belongs_to_a_layer() -> None:
    """A new folder gets its place in the layers before anything can depend on it."""
    assert not [m for m in graph() if not layer_of(m)], "modules in no layer"


def test_each_layer_imports_only_the_layers_below_it() -> None:
    """No module imports a layer its own layer may not import (lazy and type-checking imports
    included): the floor never reaches the roof, the runner and the core import nothing of ours."""
    bad = []
    for name, targets in graph().items():
        here = layer_of(name)
        if here in ROOF:
            continue
        for target in targets:
            there = layer_of(target)
            if there != here and there not in ALLOWED[here]:
                bad.append(f"{name} ({here}) imports {target} ({there})")
    assert not bad, "\n".join(sorted(bad))


def test_no_module_imports_itself_back() -> None:
    """No import cycle between modules, however long (a package's __init__ is a module: a child
    imports its siblings, not its own package)."""
    assert cycles(graph()) == []


def test_no_package_imports_itself_back() -> None:
    """No import cycle between folders: if a package imports another, nothing in the other
    imports the first."""
    pg: dict[str, set[str]] = {}
    for name, targets in graph().items():
        for target in targets:
            a, b = package_of(name), package_of(target)
            if a != b:
                pg.setdefault(a, set()).add(b)
    assert cycles(pg) == []


def test_the_runner_uses_the_standard_library_only() -> None:
    """The in-sandbox program runs under whatever python3 a sandbox has: it imports nothing from
    site-packages (but pytest, which `pytest_boot` runs under when a suite asks for it)."""
    stdlib = set(sys.stdlib_module_names) | {"tangram_runner", "__future__", "pytest", "_pytest"}
    bad = []
    for path in (ROOT / "tangram_runner").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = (
                [a.name for a in node.names]
                if isinstance(node, ast.Import)
                else [node.module or ""]
                if isinstance(node, ast.ImportFrom) and not node.level
                else []
            )
            bad += [f"{path.name}: {n}" for n in names if n.split(".")[0] not in stdlib]
    assert not bad, bad


def test_only_the_roof_starts_the_scheduler_service() -> None:
    """Clients, workers and the HTTP server do not import the scheduler service (they share the
    wire models and the pool view with it instead); the CLI and the deployment start it."""
    bad = [
        f"{name} imports {target}"
        for name, targets in graph().items()
        if layer_of(name) not in ROOF and not name.startswith("scheduler.service")
        for target in targets
        if target.startswith("scheduler.service")
    ]
    assert not bad, "\n".join(sorted(bad))


def test_importing_the_floor_loads_no_roof_module() -> None:
    """In a fresh interpreter, importing every floor module (and so the package facade) leaves
    no module of a higher layer in sys.modules."""
    floor = sorted(m for m in graph() if layer_of(m) == COMMON)
    high = sorted(set(ALLOWED) - {CORE, COMMON, "tangram_runner"} | ROOF - {"tangram_celery"})
    code = (
        "import sys\n"
        + "".join(f"import {m}\n" for m in floor)
        + f"high = {high!r}\n"
        + "print([m for m in sys.modules if any(m == r or m.startswith(r + '.') for r in high)])\n"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", out.stdout


def test_no_product_file_is_over_450_lines() -> None:
    """A module over 450 lines is doing more than one job: split it (STYLE.md, "small modules")."""
    long = {
        str(path.relative_to(ROOT)): n
        for path in modules().values()
        if (n := len(path.read_text().splitlines())) > 450
    }
    assert not long, long
