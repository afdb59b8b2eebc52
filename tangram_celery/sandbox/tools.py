"""Test tooling for inside sandboxes: pytest + pytest-xdist, copied from the worker's environment.

Sandboxes run the host's /usr/bin/python3, which has no pytest. Each worker copies the installed
files of the pure-Python distributions (and their requirements) from its own environment into its
root-only stage directory (`stage.py`; no shared cache at a predictable path that others could
plant files in), and every sandbox mounts that copy read-only at /opt/tangram/site on PYTHONPATH.
Same Python minor version is required (pure-Python wheels only); when the worker lacks them,
`copy_tools` returns False and `test_command`s that call pytest fail inside the sandbox.
"""

from __future__ import annotations

import importlib.metadata as md
import logging
import os
import re
import shutil
from pathlib import Path

log = logging.getLogger(__name__)

TOOL_DISTS = ("pytest", "pytest-xdist")
_NAME = re.compile(r"^[A-Za-z0-9_.-]+")


def _closure(roots: tuple[str, ...]) -> list[md.Distribution]:
    """The distributions `roots` need on this interpreter (markers evaluated, no extras)."""
    from packaging.requirements import Requirement

    seen: dict[str, md.Distribution] = {}
    todo = list(roots)
    while todo:
        name = todo.pop().lower().replace("_", "-")
        if name in seen:
            continue
        dist = md.distribution(name)
        seen[name] = dist
        for spec in dist.requires or []:
            req = Requirement(spec)
            if req.marker is None or req.marker.evaluate({"extra": ""}):
                todo.append(req.name)
    return list(seen.values())


def copy_tools(dest: Path, roots: tuple[str, ...] = TOOL_DISTS) -> bool:
    """Copy the files of `roots` and their requirements into `dest` (created here, inside the
    worker's root-only stage directory; directories 0755, files 0644, no links followed).
    False when the worker's environment lacks them."""
    try:
        dists = _closure(roots)
    except (md.PackageNotFoundError, ImportError) as e:
        log.warning("sandbox test tools unavailable (%s); pip install pytest pytest-xdist", e)
        return False
    tmp = dest.with_name(f".{dest.name}-new")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(mode=0o755)
    for dist in dists:
        for rel in dist.files or []:
            if rel.parts[0] == ".." or "__pycache__" in rel.parts:
                continue  # console scripts and caches live elsewhere
            src = Path(str(dist.locate_file(rel)))
            if src.is_file() and not src.is_symlink():
                target = tmp / rel
                _mkdirs(tmp, target.parent)
                shutil.copyfile(src, target, follow_symlinks=False)
                os.chmod(target, 0o644)
    tmp.rename(dest)
    tag = ",".join(sorted(f"{d.metadata['Name']}={d.version}" for d in dists))
    log.info("sandbox test tools staged at %s: %s", dest, tag)
    return True


def _mkdirs(top: Path, d: Path) -> None:
    """Create `d` and its parents below `top`, each 0755 (whatever the umask)."""
    missing = []
    while d != top and not d.exists():
        missing.append(d)
        d = d.parent
    for m in reversed(missing):
        m.mkdir()
        os.chmod(m, 0o755)
