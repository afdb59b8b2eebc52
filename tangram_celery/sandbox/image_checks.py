"""What an image sandbox refuses, and how a failure to get an image reads as a result."""

from __future__ import annotations

import logging
from typing import Any

from tangram_celery.common.actions import ActionStatus
from tangram_celery.sandbox.base import ExecRequest, ExecResult
from tangram_celery.sandbox.oci import ImageError, ImageNotFound

log = logging.getLogger("tangram_celery.sandbox.pool")


def image_failure(e: ImageError) -> ExecResult:
    """The result of an action whose image could not be had: an unknown image is the caller's
    (rejected); a full store, a corrupt image or a failed fetch is the node's (an error)."""
    log.warning("image not available: %s", e)
    status = ActionStatus.REJECTED if isinstance(e, ImageNotFound) else ActionStatus.ERROR
    return ExecResult(status=status, detail=str(e))


def image_refusal(image: str, req: ExecRequest, extras: dict[str, Any]) -> str:
    """Why `req` cannot run in `image` ("" when it can): a python program needs the image's own
    Python (the harness's never runs a user's program there), and assert tests run in the
    harness's verifiers, which an image does not have."""
    if req.language == "python" and req.code is not None and not extras["interpreter"]:
        return f"image {image!r} has no python3 (or python) for a python action; run it as bash"
    if req.test_command and "pytest" in req.test_command and not extras["interpreter"]:
        return f"image {image!r} has no python3 (or python) to run pytest in its test_command"
    if any(t.assert_code is not None for t in req.test_cases):
        return f"assert tests do not run in an image ({image!r}); use a test_command (pytest) or stdin tests"
    return ""
