"""The client side of the store on a blocking connection: it sends the calls of `client_ops`
(which builds every command and reads every reply) for `TangramClient`. The asyncio client's
executor of the same calls is `client_aio.py`.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

import tangram_celery.store.client_ops as ops
from tangram_celery.common.wire import PoolView
from tangram_celery.store.base import StoreBase
from tangram_celery.store.scripts import SUBMIT


class ClientSide(StoreBase):
    """What a client does, for its tenant (`StoreBase.tenant`): every id it is given or returns
    is the tenant's own; the keys are the tenant's (`keys.akey` of the qualified id)."""

    def submit(
        self,
        items: Sequence[ops.Item],
        max_queued: int,
        *,
        ttl_s: float = 0.0,
        admit_memory_fraction: float = 0.8,
    ) -> list[str]:
        """Enqueue (id, meta_json, payload_json) items atomically each; raise on the first refusal;
        return the ids that were submitted before (`check_submitted`).

        Items before a refused one stay enqueued (they are valid and were accepted). A payload
        not run within `ttl_s` expires (0 = never). Nothing is enqueued while Redis is above
        `admit_memory_fraction` of its `maxmemory` (`client_ops.MemoryCheck`).
        """
        self._admit_memory(admit_memory_fraction, len(items))

        def send() -> list[Any]:
            batch = ops.SubmitBatch(items, max_queued, ops.ttl_arg(ttl_s), notify="", tenant=self.tenant)
            while not batch.take(self.send_all(batch.pending(), raise_on_error=False)):
                self.load_script(SUBMIT)
            return batch.replies

        return ops.check_submitted(items, self.retrying("submit", send), max_queued)

    def _admit_memory(self, fraction: float, n: int) -> None:
        now = time.monotonic()
        if self._memory.due(now):
            self._memory.saw(self.memory_use(), now)
        self._memory.admit(fraction, n)

    def control(self, fields: dict[str, str]) -> None:
        """A control message on this tenant's intake (`client_ops.control`)."""
        self.run(ops.control(fields, tenant=self.tenant))

    def close_trajectory(self, trajectory_id: str) -> None:
        self.run(ops.close_trajectory(trajectory_id, self.tenant))

    def cancel(self, action_id: str, result_json: str) -> str:
        """Cancel an action that no scheduler has dispatched yet (`client_ops.cancel`)."""
        notify = self.run(ops.notify_of(self.qualified(action_id)))
        return self.run(ops.cancel(action_id, result_json, self.tenant, notify))

    def wait_result(
        self, action_id: str, timeout_s: float | None, poll_s: float = 2.0, look_first: bool = False
    ) -> str | None:
        """Block until the action's result exists; return its JSON, or None on timeout.

        The completion script stores the result in the action's hash (the truth) and pushes a
        copy onto `n:<id>` to wake the waiter. The push is consumed by whoever pops it, and a
        pop whose reply was lost (Redis died mid-reply) consumes it too, so the waiter never
        relies on it alone: every `poll_s` without a wake-up it reads the hash. `look_first`: read
        it before the first wait (the action may have completed before this waiter existed:
        a resubmission, or a handle made for an earlier client's action).
        """
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        wait = not look_first  # (else the first pass reads the hash without waiting)
        q = self.qualified(action_id)
        while True:
            left = poll_s if deadline is None else min(poll_s, deadline - time.monotonic())
            res = self.run(ops.pop_result(q, left)) if wait and left > 0 else None
            if res is None:
                res = self.run(ops.stored_result(q))
            if res is not None:
                self.read_done(action_id)
                return res
            wait = True
            if deadline is not None and time.monotonic() >= deadline:
                return None

    def read_done(self, action_id: str) -> None:
        self.run(ops.read_done(self.qualified(action_id)))

    def action_state(self, action_id: str) -> str | None:
        """The state of this tenant's `action_id`; the scheduler's side passes qualified ids
        (its tenant is the default one, which qualifies nothing)."""
        return self.run(ops.state(self.qualified(action_id)))

    def pool_view(self) -> PoolView | None:
        return self.run(ops.pool_view())

    def languages(self) -> dict[str, list[str]]:
        return self.run(ops.languages())

    def queued_count(self) -> int:
        return self.run(ops.queued_count(self.tenant))
