"""`TANGRAM_PRETEND_MISSING`: make this process (and the tests) behave as if components were absent.

A comma-separated list of names, e.g. `TANGRAM_PRETEND_MISSING=bwrap,builtin,docker`. It lets one
machine check the fallback paths of a fresh machine (a built-in launcher instead of bubblewrap,
tests that skip with their reason when no sandbox can run) without uninstalling anything.
Names: `bwrap` (bubblewrap), `builtin` (the built-in namespace launcher), `docker` (any Docker
engine), and commands the tests look up (`dockerd`, `chromium`, `ip`, `gcc`).
"""

from __future__ import annotations

import os

ENV = "TANGRAM_PRETEND_MISSING"


def pretend_missing(name: str) -> bool:
    """True when `name` is listed in TANGRAM_PRETEND_MISSING."""
    return name in {n.strip() for n in os.environ.get(ENV, "").split(",") if n.strip()}
