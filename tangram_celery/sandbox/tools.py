"""Test tooling for inside sandboxes: pytest + pytest-xdist, copied from the worker's environment.

Sandboxes run the host's /usr/bin/python3, which has no pytest. We copy the installed files of
the pure-Python distributions (and their requirements) from the worker's own environment into a
cache directory once, and every sandbox mounts it read-only at /opt/tangram/site on PYTHONPATH.
Same Python minor version is required (pure-Python wheels only); when the worker lacks them,
`tools_dir` returns None and `test_command`s that call pytest fail inside the sandbox.
"""

from __future__ import annotations

import hashlib
import importlib.metadata as md
import logging
import os
import re
import shutil
import sys
import tempfile
from pathlib import Path

log = logging.getLogger(__name__)

TOOL_DISTS = ("pytest", "pytest-xdist")
CACHE_ROOT = Path(tempfile.gettempdir()) / "tangram-sandbox-tools"
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


def tools_dir(roots: tuple[str, ...] = TOOL_DISTS) -> Path | None:
    """A read-only-mountable site-packages dir holding `roots`, built once per version set."""
    try:
        dists = _closure(roots)
    except (md.PackageNotFoundError, ImportError) as e:
        log.warning("sandbox test tools unavailable (%s); pip install pytest pytest-xdist", e)
        return None
    tag = ",".join(sorted(f"{d.metadata['Name']}={d.version}" for d in dists))
    tag += f";py{sys.version_info[0]}.{sys.version_info[1]}"
    dest = CACHE_ROOT / hashlib.sha256(tag.encode()).hexdigest()[:16]
    if dest.is_dir():
        return dest
    CACHE_ROOT.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=CACHE_ROOT, prefix=".build-"))
    for dist in dists:
        for rel in dist.files or []:
            if rel.parts[0] == ".." or "__pycache__" in rel.parts:
                continue  # console scripts and caches live elsewhere
            src = Path(str(dist.locate_file(rel)))
            if src.is_file():
                target = tmp / rel
                target.parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(src, target)
    for p in [tmp, *tmp.rglob("*")]:
        os.chmod(p, 0o755 if p.is_dir() else 0o644)
    try:
        tmp.rename(dest)
    except OSError:  # another worker built it first
        shutil.rmtree(tmp, ignore_errors=True)
    log.info("sandbox test tools at %s: %s", dest, tag)
    return dest
