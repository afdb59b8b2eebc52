"""Tangram: action-level orchestration of external resources for agentic RL, on Celery."""

from tangram_celery.aclient import AsyncActionHandle, AsyncTangramClient
from tangram_celery.actions import (
    ActionResult,
    ActionStatus,
    ApiAction,
    CodeAction,
    RewardAction,
    TestCase,
)
from tangram_celery.client import ActionHandle, TangramClient
from tangram_celery.errors import ActionRejected, AdmissionError, TangramError

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
