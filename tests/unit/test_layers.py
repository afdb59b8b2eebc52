"""The import layers: the floor never imports the roof, and the scheduler service has no cycles.

- core: `scheduler` (the pure scheduling code) without its service and simulator;
- floor: what every process shares: config, errors, actions, admission, wire, the store, the
  Celery app, metrics, the embedded broker;
- roof: the clients, workers, CLI, HTTP server, deployment and the scheduler service.

Core imports only core; the floor imports core and floor (and the reward backends' input
schemas); neither imports the roof, not even lazily inside a function or for type checking.
Every import statement is read from the source (AST), so a new import is checked when added.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
FLOOR = {
    "tangram_celery.common.errors",
    "tangram_celery.common.config",
    "tangram_celery.common.config_front",
    "tangram_celery.common.actions",
    "tangram_celery.common.admission",
    "tangram_celery.common.wire",
    "tangram_celery.store",
    "tangram_celery.transport.app",
    "tangram_celery.common.metrics",
    "tangram_celery.transport.broker",
    "tangram_celery.common.lifeline",
}
ROOF = {
    "tangram_celery.client.sync",
    "tangram_celery.client.aio",
    "tangram_celery.workers",
    "tangram_celery.cli",
    "tangram_celery.web",
    "tangram_celery.deploy",
    "tangram_celery.demo",
    "tangram_celery.integrations",
    "tangram_celery.testing",
    "scheduler.service",
}


def modules() -> dict[str, Path]:
    """Every module of the three packages: dotted name -> file."""
    out = {}
    for pkg in ("scheduler", "tangram_celery", "reward_servers"):
        for path in (ROOT / pkg).rglob("*.py"):
            parts = list(path.relative_to(ROOT).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            out[".".join(parts)] = path
    return out


def imports(name: str, path: Path, known: set[str]) -> set[str]:
    """The modules of `known` that `name` imports anywhere in its source."""
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
            if t:
                out.add(t)
    return out


def layer(name: str, groups: set[str]) -> bool:
    return any(name == g or name.startswith(g + ".") for g in groups)


def is_core(name: str) -> bool:
    return name.startswith("scheduler") and not layer(name, {"scheduler.service", "scheduler.sim"})


def test_floor_and_core_never_import_the_roof() -> None:
    """No floor or core module imports a roof module, at the top, in a function or for typing;
    core imports nothing of tangram_celery or reward_servers."""
    mods = modules()
    known = set(mods)
    bad = []
    for name, path in mods.items():
        floor, core = layer(name, FLOOR), is_core(name)
        if not (floor or core):
            continue
        for target in imports(name, path, known):
            if layer(target, ROOF) or (core and not is_core(target) and target != name):
                bad.append(f"{name} imports {target}")
    assert not bad, "\n".join(sorted(bad))


def test_only_the_cli_starts_the_scheduler_service() -> None:
    """Clients, workers and the HTTP server do not import the scheduler service (they share
    the wire models and the pool view with it instead); the CLI and the deployment start it."""
    mods = modules()
    known = set(mods)
    bad = [
        f"{name} imports {target}"
        for name, path in mods.items()
        if name.startswith("tangram_celery")
        and not layer(name, {"tangram_celery.cli", "tangram_celery.deploy"})
        for target in imports(name, path, known)
        if layer(target, {"scheduler.service"})
    ]
    assert not bad, "\n".join(sorted(bad))


def test_importing_the_floor_loads_no_roof_module() -> None:
    """In a fresh interpreter, importing every floor module (and so the package facade) leaves
    no roof module in sys.modules."""
    code = (
        "import sys\n"
        + "".join(f"import {m}\n" for m in sorted(FLOOR))
        + f"roof = {sorted(ROOF)!r}\n"
        + "print([m for m in sys.modules if any(m == r or m.startswith(r + '.') for r in roof)])\n"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", out.stdout


def test_the_scheduler_service_has_no_import_cycle() -> None:
    """The modules of scheduler.service import each other without a cycle (type-checking
    imports included): the loop applies what the parts decide, no part reaches back into it."""
    mods = {n: p for n, p in modules().items() if n.startswith("scheduler.service.")}
    graph = {n: {t for t in imports(n, p, set(mods)) if t != n} for n, p in mods.items()}
    state: dict[str, int] = {}
    path: list[str] = []

    def visit(n: str) -> None:
        state[n] = 1
        path.append(n)
        for m in sorted(graph[n]):
            if state.get(m) == 1:
                cycle = [*path[path.index(m) :], m]
                raise AssertionError("import cycle: " + " -> ".join(cycle))
            if m not in state:
                visit(m)
        path.pop()
        state[n] = 2

    for n in sorted(graph):
        if n not in state:
            visit(n)
    assert "scheduler.service.loop" not in set().union(*graph.values())
