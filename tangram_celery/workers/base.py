"""What every worker does around its resource-specific handler.

claim (dispatched -> running, exactly once) -> load the payload -> run the handler -> store
the result, wake the client and emit the release event (one Lua script). A handler returns an
`ActionResult`-shaped dict of the user's outcome; infrastructure exceptions become status
`error` after the handler's own retries.
"""

from __future__ import annotations

import json
import logging
import socket
import time
from collections.abc import Callable
from typing import Any

from tangram_celery.actions import ActionResult, ActionStatus
from tangram_celery.store import Store

log = logging.getLogger("tangram.worker")

Handler = Callable[[str, dict[str, Any], dict[str, Any]], ActionResult]
"""handler(action_id, payload, allocation) -> ActionResult (timings are filled in by execute)."""


class WorkerRuntime:
    """Per-process worker state: the store connection and the worker's name."""

    def __init__(self, broker_url: str, name: str) -> None:
        self.store = Store(broker_url)
        self.name = f"{name}@{socket.gethostname()}"

    def execute(self, action_id: str, alloc: dict[str, Any], handler: Handler) -> str:
        """Run one dispatched action exactly once; returns its final status (or why it was skipped)."""
        started = time.time()
        claimed = self.store.claim(action_id, self.name, started)
        if isinstance(claimed, str):
            log.info("skip %s: state is %s (duplicate delivery)", action_id, claimed)
            return f"skipped:{claimed}"
        meta_raw, payload_raw, _ = claimed
        meta = json.loads(meta_raw)
        payload = json.loads(payload_raw)
        try:
            result = handler(action_id, payload, alloc)
        except Exception as e:  # an infrastructure failure: the user's code never raises here
            log.exception("action %s failed in the worker", action_id)
            result = ActionResult(
                action_id=action_id, status=ActionStatus.ERROR, error=f"{type(e).__name__}: {e}"
            )
        finished = time.time()
        result.trajectory_id = meta["trajectory_id"]
        submitted = float(meta["submitted_s"])
        result.queue_s = max(0.0, started - submitted)
        if not result.exec_s:
            result.exec_s = finished - started
        result.act_s = max(0.0, finished - submitted)
        result.units = int(alloc.get("units", 0))
        result.node = str(alloc.get("pool", ""))
        event = {
            "status": str(result.status),
            "exec_s": result.exec_s,
            "units": result.units,
            "trajectory_id": result.trajectory_id,
        }
        self.store.complete(action_id, result.model_dump_json(), event)
        return str(result.status)
