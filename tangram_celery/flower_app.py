"""The Celery app Flower runs with (`celery -A tangram_celery.flower_app flower`, see
`deploy.flower_command`): its broker page then lists every per-resource queue with its length.

Flower's broker page lists the queues of the workers it has inspected (at its start, or on a
workers-page Refresh); a worker that came up later (a GPU worker still starting Triton) or has
not been inspected yet is missing, and with no worker inspected Flower falls back to the app's
`task_queues`. This app declares the queue of every configured pool (`TANGRAM_FLOWER_QUEUES`,
comma-separated, set by `flower_command`), and the page lists the union of both.

Tenants (issue 37): Flower is the operator's, and it shows tenants by name only. A task's
arguments are an action id and its order (allocation, attempt, sandbox), and their repr the
action's kind, trajectory and units (`scheduler.service.sender`); a named tenant's ids read
`<tenant>/<id>`. A task's result is its status word. Payloads, outputs and results stay in the
tenants' own keys, which Flower's Redis user cannot read (`transport.acl`).
"""

from __future__ import annotations

import os
from typing import Any

from kombu import Queue

from tangram_celery.transport.app import make_app

QUEUES = sorted({q for q in os.environ.get("TANGRAM_FLOWER_QUEUES", "").split(",") if q})

app = make_app(os.environ.get("BROKER_URL", "redis://127.0.0.1:6379/0"))
app.conf.task_queues = [Queue(q) for q in QUEUES]


def _patch_flower() -> None:
    """List the configured queues beside the inspected workers' ones on the broker page."""
    try:
        from flower.views import BaseHandler
    except ImportError:  # imported outside Flower (tests of this module): nothing to patch
        return
    inspected = getattr(BaseHandler, "get_active_queue_names", None)
    if inspected is None or getattr(inspected, "_tangram", False):
        return

    def queue_names(self: Any) -> list[str]:
        names = {
            q["name"]
            for info in self.application.workers.values()
            for q in info.get("active_queues", [])
            if q.get("name")
        }
        return sorted(names | {q.name for q in self.capp.conf.task_queues or [] if q.name})

    queue_names._tangram = True  # type: ignore[attr-defined]
    BaseHandler.get_active_queue_names = queue_names


_patch_flower()
