"""Tangram: action-level orchestration of external resources for agentic RL, on Celery.

The clients are imported on first use (PEP 562): importing a lower module of the package (the
config, the action models, the store) does not load the clients and their dependencies.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from tangram_celery.common.actions import ActionStatus, ApiAction, CodeAction, RewardAction, TestCase
from tangram_celery.common.errors import ActionRejected, AdmissionError, TangramError
from tangram_celery.common.wire import ActionResult

if TYPE_CHECKING:
    from tangram_celery.client.aio import AsyncActionHandle, AsyncTangramClient
    from tangram_celery.client.sync import ActionHandle, TangramClient

_LAZY = {
    "ActionHandle": "tangram_celery.client.sync",
    "TangramClient": "tangram_celery.client.sync",
    "AsyncActionHandle": "tangram_celery.client.aio",
    "AsyncTangramClient": "tangram_celery.client.aio",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'tangram_celery' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


__all__ = [
    "ActionHandle",
    "ActionRejected",
    "ActionResult",
    "ActionStatus",
    "AdmissionError",
    "ApiAction",
    "AsyncActionHandle",
    "AsyncTangramClient",
    "CodeAction",
    "RewardAction",
    "TangramClient",
    "TangramError",
    "TestCase",
]
