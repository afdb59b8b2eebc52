"""Lazy imports of the heavy optional dependencies, with an error that says how to install them."""

from __future__ import annotations

import importlib
from types import ModuleType

from tangram_celery.errors import RewardServerError

INSTALL_HINT = (
    "install the reward extra: `pip install -r requirements/reward.txt && pip install -e '.[reward]'` "
    "(torch==2.13.0 first, so that pip never pulls a CUDA build)"
)


def require(module: str) -> ModuleType:
    """Import `module` or raise RewardServerError naming the install command."""
    try:
        return importlib.import_module(module)
    except ImportError as e:
        raise RewardServerError(f"{module} is not installed ({e}); {INSTALL_HINT}") from None
