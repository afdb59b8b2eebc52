"""TangramClient: what rollout workers use to submit actions and wait for their results.

    client = TangramClient.from_config("configs/local.yaml")
    h = client.submit(CodeAction(trajectory_id="t1", code="print(1)"))
    print(h.result(timeout=30).stdout)

Payloads go straight to Redis (`tangram:a:<id>`); only metadata passes through the scheduler.
"""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Iterable
from typing import Any

import tangram_celery.store.client_ops as ops
from tangram_celery.client.core import ClientCore, fork_action, forked
from tangram_celery.common.admission import AnyAction, cancelled_result
from tangram_celery.common.config import TangramConfig, load_config
from tangram_celery.common.errors import ResultTimeout
from tangram_celery.common.wire import ActionResult
from tangram_celery.store import Store
from tangram_celery.transport.broker import resolve_url

__all__ = ["ActionHandle", "AnyAction", "TangramClient"]


class ActionHandle:
    """A submitted action. `result()` blocks until it finishes (or the timeout passes)."""

    def __init__(
        self, client: TangramClient, action_id: str, trajectory_id: str, look_first: bool = False
    ) -> None:
        self.client = client
        self.id = action_id
        self.trajectory_id = trajectory_id
        self._result: ActionResult | None = None
        self._look_first = look_first  # its result may predate this handle (`Store.wait_result`)

    def result(self, timeout: float | None = 60.0) -> ActionResult:
        """The action's result; raises ResultTimeout if none arrives within `timeout` seconds."""
        if self._result is None:
            raw = self.client.store.wait_result(self.id, timeout, look_first=self._look_first)
            if raw is None:
                raise ResultTimeout(
                    f"action {self.id} has no result after {timeout}s (it may still complete)"
                )
            self._result = ActionResult.model_validate_json(raw)
        return self._result

    def done(self) -> bool:
        return self._result is not None or self.client.store.action_state(self.id) == "done"

    def __repr__(self) -> str:
        return f"ActionHandle({self.id!r})"


class TangramClient:
    """Submit actions to a running Tangram deployment (thread-safe; one per process is enough)."""

    def __init__(
        self,
        broker_url: str,
        *,
        config: TangramConfig | None = None,
        store: Store | None = None,
        tenant: str | None = None,
    ) -> None:
        """`tenant`: whose work this client submits and reads (default: the one its URL's Redis
        user acts as, `tenants.tenant_of_user`); its ids are that tenant's own."""
        self.store = store or Store(broker_url, socket_timeout_s=None, tenant=tenant)
        self.tenant = self.store.tenant
        self.config = config
        self.core = ClientCore(config)

    @classmethod
    def from_config(cls, path: str | os.PathLike[str]) -> TangramClient:
        cfg = load_config(path)
        return cls(resolve_url(cfg), config=cfg)

    def _read_pools(self) -> None:
        """The deployment's pools and languages, where `core` wants them read."""
        now = time.monotonic()
        if self.core.wants_view(now):
            self.core.saw_view(self.store.pool_view(), now)
        if self.core.view is not None and self.core.wants_languages(now):
            self.core.saw_languages(self.store.languages(), now)
            self.core.saw_images(self.store.run(ops.images()))

    # ---- submit ----------------------------------------------------------------------------
    def submit(self, action: AnyAction | dict[str, Any]) -> ActionHandle:
        """Validate and enqueue one action. Raises ActionRejected / AdmissionError, enqueuing nothing."""
        return self.submit_many([action])[0]

    def submit_many(self, actions: Iterable[AnyAction | dict[str, Any]]) -> list[ActionHandle]:
        """Validate all, then enqueue all in one round trip. Nothing is enqueued if any is invalid."""
        now = time.time()
        self._read_pools()
        batch = self.core.batch(actions, now)
        again = set(
            self.store.submit(
                batch.items,
                batch.max_queued,
                ttl_s=batch.queued_ttl_s,
                admit_memory_fraction=batch.admit_memory_fraction,
            )
        )
        return [
            ActionHandle(self, action_id, tid, look_first=action_id in again)
            for (action_id, _, _), tid in zip(batch.items, batch.trajectories, strict=True)
        ]

    def handle(self, action_id: str, trajectory_id: str = "") -> ActionHandle:
        """A handle for an action submitted earlier, e.g. by a client process that died."""
        return ActionHandle(self, action_id, trajectory_id, look_first=True)

    async def run(self, action: AnyAction | dict[str, Any], timeout: float | None = 600.0) -> ActionResult:
        """Submit and await the result without blocking the event loop."""
        handle = self.submit(action)
        return await asyncio.get_running_loop().run_in_executor(None, handle.result, timeout)

    def fork(
        self, trajectory_id: str, n: int = 0, ids: list[str] | None = None, timeout: float | None = 600.0
    ) -> list[str]:
        """Start `n` new trajectories (or the given `ids`) from a copy of the files of
        `trajectory_id`, a trajectory in a container image, once its earlier actions ran: each
        then goes its own way (GRPO's n samples of one prepared task state). Returns their ids;
        TangramError when the fork was not made."""
        action, new = fork_action(trajectory_id, n, ids)
        return forked(trajectory_id, new, self.submit(action).result(timeout))

    def close_trajectory(self, trajectory_id: str) -> None:
        """The trajectory is finished: its sandbox and reserved memory are released once its
        queued and running actions are done."""
        self.store.close_trajectory(trajectory_id)

    def cancel(self, action_id: str, reason: str = "cancelled by its caller") -> bool:
        """Withdraw an action that no scheduler has dispatched yet. True: it will never run and
        its result has status `cancelled`. False: it was already dispatched (it runs to the
        end), finished, or is unknown."""
        return self.store.cancel(action_id, cancelled_result(action_id, reason)) == "cancelled"

    def close(self) -> None:
        self.store.close()

    def __enter__(self) -> TangramClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
