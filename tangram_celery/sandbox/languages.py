"""Which languages this host's sandboxes can run, found by looking for their toolchains.

Sandboxes see the host's /usr, /lib, /lib64, /bin and /sbin read-only (both backends), so a
language is available when every tool it needs resolves, on the host, to an executable under
those paths. Links are resolved here (/usr/bin/java -> /etc/alternatives/java -> /usr/lib/jvm/...)
and the real paths go to the runner, since the sandbox has no /etc. A JDK also reads its
configuration through links into /etc/java-<N>-openjdk: that directory is bound read-only into
sandboxes (`extra_ro_paths`) when Java is available.

`sandbox.languages` in the config narrows the set (an operator may keep a heavy toolchain off a
node); the CPU worker publishes what is left, and clients refuse actions in anything else.
"""

from __future__ import annotations

import functools
import os
import shutil
from collections.abc import Sequence
from pathlib import Path

from tangram_celery.common.actions import COMPILED_LANGUAGES, LANGUAGES
from tangram_celery.sandbox.limits import HOST_RO_PATHS, SANDBOX_PYTHON

# language -> (tool name -> the host command it is looked up as)
TOOLS: dict[str, dict[str, str]] = {
    "python": {"python3": SANDBOX_PYTHON},
    "bash": {"bash": "/bin/bash"},
    "c": {"gcc": "gcc"},
    "cpp": {"g++": "g++"},
    "nodejs": {"node": "node"},
    "go": {"go": "go"},
    "java": {"javac": "javac", "java": "java"},
    "rust": {"rustc": "rustc", "gcc": "gcc"},  # rustc links through gcc
}
DEBIAN_PACKAGES = {
    "c": "gcc",
    "cpp": "g++",
    "nodejs": "nodejs",
    "go": "golang-go",
    "java": "default-jdk-headless",
    "rust": "rustc",
}
SEARCH_PATH = "/usr/local/bin:/usr/bin:/bin"  # never the caller's PATH (~/.cargo/bin is not in a sandbox)


def _inside(path: str) -> bool:
    return any(path == top or path.startswith(top + "/") for top in HOST_RO_PATHS)


def resolve(command: str) -> str | None:
    """The real path of `command` if a sandbox can run it, else None."""
    found = command if command.startswith("/") else shutil.which(command, path=SEARCH_PATH)
    if found is None:
        return None
    real = os.path.realpath(found)
    return real if _inside(real) and os.access(real, os.X_OK) else None


@functools.cache
def detect() -> dict[str, dict[str, str]]:
    """language -> {tool: real path} for every language whose toolchain this host has."""
    out: dict[str, dict[str, str]] = {}
    for lang in LANGUAGES:
        tools = {name: resolve(cmd) for name, cmd in TOOLS[lang].items()}
        if all(tools.values()):
            out[lang] = {k: v for k, v in tools.items() if v is not None}
    return out


def available(configured: Sequence[str] | None = None) -> list[str]:
    """The languages sandboxes here run: detected, narrowed to `configured` when given."""
    found = detect()
    return [lang for lang in LANGUAGES if lang in found and (configured is None or lang in configured)]


def tools_for(language: str) -> dict[str, str]:
    """The tools the runner needs for `language` (empty when it is not available)."""
    return dict(detect().get(language, {}))


def missing_hint(language: str) -> str:
    """How to make `language` available, for error messages."""
    pkg = DEBIAN_PACKAGES.get(language)
    return f"install the Debian package {pkg} on the CPU nodes" if pkg else "no toolchain for it"


@functools.cache
def extra_ro_paths() -> tuple[str, ...]:
    """Host directories outside HOST_RO_PATHS that a toolchain reads: the JDK's configuration
    in /etc (its conf files and lib/jvm.cfg are links there)."""
    java = detect().get("java")
    if java is None:
        return ()
    home = Path(java["java"]).parent.parent
    out: set[str] = set()
    for link in (home / "lib" / "jvm.cfg", home / "conf" / "security" / "java.security"):
        if link.is_symlink():
            target = os.path.realpath(link)
            parts = Path(target).parts  # ('/', 'etc', 'java-17-openjdk', ...)
            if len(parts) > 3 and parts[1] == "etc":
                out.add(str(Path(*parts[:3])))
    return tuple(sorted(out))


__all__ = ["COMPILED_LANGUAGES", "LANGUAGES", "available", "detect", "extra_ro_paths", "tools_for"]
