"""Reward-server errors: a sub-tree of `RewardServerError` (itself under `TangramError`).

`retryable` tells the worker whether the same actions may succeed elsewhere or after a restart.
"""

from __future__ import annotations

from tangram_celery.common.errors import RewardServerError


class TritonCrashed(RewardServerError):
    """The tritonserver process died or stopped answering; it is being restarted."""

    retryable = True


class ModelLoadFailed(RewardServerError):
    """Triton could not load a replica (bad model directory, backend error, out of memory)."""

    retryable = True

    def __init__(self, name: str, reason: str) -> None:
        super().__init__(f"loading {name!r} failed: {reason}")
        self.name = name
        self.reason = reason


class NoCapacity(RewardServerError):
    """Every candidate chunk is held by in-flight requests; try again later or elsewhere."""

    retryable = True


class InputRejected(RewardServerError):
    """Unknown model or malformed inputs: rejected at submit, never retried."""

    retryable = False


class InferenceFailed(RewardServerError):
    """The backend raised while scoring a batch (the model stays loaded)."""

    retryable = False
