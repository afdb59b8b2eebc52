"""API handlers used by integration tests (imported by real worker processes)."""

from __future__ import annotations

import os
import time
from typing import Any


def record(request: dict[str, Any]) -> dict[str, Any]:
    """Append the request's tag to a log file (one line per execution), after `sleep_s`."""
    time.sleep(float(request.get("sleep_s", 0.0)))
    fd = os.open(request["log"], os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
    try:
        os.write(fd, (str(request["tag"]) + "\n").encode())
    finally:
        os.close(fd)
    return {"tag": request["tag"]}
