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


class ProviderUnavailable(Exception):
    """An infrastructure failure that may succeed on another try (like a provider's 503)."""

    retryable = True


def flaky(request: dict[str, Any]) -> dict[str, Any]:
    """Raise ProviderUnavailable for the first `fail_times` calls of a tag, then `record` it.
    Every call appends `<tag> try` to `<log>.tries`."""
    with open(str(request["log"]) + ".tries", "a") as f:
        f.write(f"{request['tag']}\n")
    with open(str(request["log"]) + ".tries") as f:
        tries = sum(1 for line in f if line.strip() == str(request["tag"]))
    if tries <= int(request.get("fail_times", 1)):
        raise ProviderUnavailable(f"try {tries} of {request['tag']}: provider unavailable")
    return record(request)
