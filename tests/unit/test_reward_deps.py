"""A deployment that serves reward models on Triton fails at start, with the fix, when what that
needs is not installed."""

from __future__ import annotations

import pytest

from reward_servers.backends.deps import check_serving
from tangram_celery.common.config import parse_config
from tangram_celery.common.errors import RewardServerError


def test_missing_model_package_is_named_with_the_install_command() -> None:
    """Given a model shipped by a package that is not installed, the check names the package,
    the model and the install command; a config with only rule models needs nothing."""
    gpu = {
        "gpu": [{"name": "g", "num_gpus": 1, "gpu_memory_mb": 1024}],
        "cpu": [{"name": "c", "cores": 1, "memory_mb": 512}],
    }
    cfg = parse_config(
        {
            "nodes": gpu,
            "reward_models": [{"name": "emb", "backend": "embedding-sim", "package": "no-such-model-pkg"}],
        }
    )
    with pytest.raises(RewardServerError, match=r"\(emb\).*no_such_model_pkg.*requirements/reward.txt"):
        check_serving(cfg)
    check_serving(
        parse_config(
            {"nodes": gpu, "reward_models": [{"name": "m", "backend": "rule", "rule": "math-equiv"}]}
        )
    )
