"""TangramClient: what rollout workers use to submit actions and wait for their results.

    client = TangramClient.from_config("configs/local.yaml")
    h = client.submit(CodeAction(trajectory_id="t1", code="print(1)"))
    print(h.result(timeout=30).stdout)

Payloads go straight to Redis (`tangram:a:<id>`); only metadata passes through the scheduler.
"""

from __future__ import annotations

import asyncio
import json
import os
import time
from collections.abc import Iterable
from typing import Any

from pydantic import TypeAdapter, ValidationError

from tangram_celery.actions import Action, ActionResult, ActionStatus, ApiAction, CodeAction, RewardAction
from tangram_celery.admission import limits_from_view, payload_errors
from tangram_celery.broker import resolve_url
from tangram_celery.config import LimitsConfig, TangramConfig, load_config
from tangram_celery.errors import ActionRejected, ResultTimeout
from tangram_celery.store import Store

_ACTION = TypeAdapter(Action)
AnyAction = CodeAction | RewardAction | ApiAction


class ActionHandle:
    """A submitted action. `result()` blocks until it finishes (or the timeout passes)."""

    def __init__(self, client: TangramClient, action_id: str, trajectory_id: str) -> None:
        self.client = client
        self.id = action_id
        self.trajectory_id = trajectory_id
        self._result: ActionResult | None = None

    def result(self, timeout: float | None = 60.0) -> ActionResult:
        """The action's result; raises ResultTimeout if none arrives within `timeout` seconds."""
        if self._result is None:
            raw = self.client.store.wait_result(self.id, timeout)
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


def action_meta(action: AnyAction, submitted_s: float) -> dict[str, Any]:
    """The metadata the scheduler decides on (no code, prompts or request bodies)."""
    meta: dict[str, Any] = {
        "id": action.id,
        "type": action.type,
        "trajectory_id": action.trajectory_id or "",
        "job_id": action.job_id,
        "priority": action.priority,
        "timeout_s": action.timeout_s,
        "submitted_s": submitted_s,
    }
    if action.one_shot:
        meta["ephemeral"] = True
    if isinstance(action, CodeAction):
        meta.update(
            cpus=list(action.cpu_range),
            memory_mb=action.memory_mb,
            has_tests=bool(action.test_cases or action.test_command),
        )
    elif isinstance(action, RewardAction):
        meta["model"] = action.model
    else:
        meta["api"] = action.api
    return meta


def coerce_action(action: AnyAction | dict[str, Any]) -> AnyAction:
    """The action model for a dict (validated), or the model itself."""
    if isinstance(action, CodeAction | RewardAction | ApiAction):
        return action
    try:
        return _ACTION.validate_python(action)
    except ValidationError as e:
        raise ActionRejected(f"invalid action: {e}") from None


def pool_view_of(config: TangramConfig) -> dict[str, Any]:
    from scheduler.service.cluster import pool_view

    return pool_view(config)


def check_action(
    action: AnyAction, meta: dict[str, Any], view: dict[str, Any] | None, limits: LimitsConfig
) -> None:
    """Raise ActionRejected if `action` exceeds the payload caps `limits` or can never run on the
    deployment described by `view` (None: no scheduler has published its pools yet; it will
    check on intake)."""
    from scheduler.service.cluster import check_meta

    too_big = payload_errors(action, limits)
    if too_big:
        raise ActionRejected(f"action {action.id} rejected: too large: " + "; ".join(too_big))
    if view is None:
        return
    why = check_meta(meta, view)
    if why is None and isinstance(action, RewardAction):
        from reward_servers.backends import input_errors

        errors = input_errors(view["models"][action.model]["backend"], action.inputs)
        why = f"inputs for {action.model!r}: " + "; ".join(errors) if errors else None
    if why is not None:
        raise ActionRejected(f"action {action.id} rejected: {why}")


def encode_action(action: AnyAction, meta: dict[str, Any], limits: LimitsConfig) -> tuple[str, str, str]:
    """(id, meta JSON, payload JSON) of a checked action; ActionRejected beyond max_payload_bytes."""
    payload = action.model_dump_json()
    size = len(payload.encode())
    if size > limits.max_payload_bytes:
        raise ActionRejected(
            f"action {action.id} rejected: {size} bytes as JSON > "
            f"{limits.max_payload_bytes} (limits.max_payload_bytes)"
        )
    return action.id, json.dumps(meta), payload


def cancelled_result(action_id: str, reason: str) -> str:
    """The stored result of an action cancelled before it ran (JSON)."""
    return ActionResult(
        action_id=action_id,
        status=ActionStatus.CANCELLED,
        error=f"cancelled before it ran: {reason}",
        attempts=0,
    ).model_dump_json()


class TangramClient:
    """Submit actions to a running Tangram deployment (thread-safe; one per process is enough)."""

    def __init__(self, broker_url: str, *, config: TangramConfig | None = None) -> None:
        self.store = Store(broker_url, socket_timeout_s=None)
        self.config = config
        self._view: dict[str, Any] | None = None

    @classmethod
    def from_config(cls, path: str | os.PathLike[str]) -> TangramClient:
        cfg = load_config(path)
        return cls(resolve_url(cfg), config=cfg)

    # ---- validation ------------------------------------------------------------------------
    def _coerce(self, action: AnyAction | dict[str, Any]) -> AnyAction:
        return coerce_action(action)

    def _check(self, action: AnyAction, meta: dict[str, Any]) -> None:
        if self._view is None:
            self._view = pool_view_of(self.config) if self.config else self.store.published_config()
        check_action(action, meta, self._view, self._limits())

    def _limits(self) -> LimitsConfig:
        return self.config.limits if self.config else limits_from_view(self._view)

    # ---- submit ----------------------------------------------------------------------------
    def submit(self, action: AnyAction | dict[str, Any]) -> ActionHandle:
        """Validate and enqueue one action. Raises ActionRejected / AdmissionError, enqueuing nothing."""
        return self.submit_many([action])[0]

    def submit_many(self, actions: Iterable[AnyAction | dict[str, Any]]) -> list[ActionHandle]:
        """Validate all, then enqueue all in one round trip. Nothing is enqueued if any is invalid."""
        now = time.time()
        items: list[tuple[str, str, str]] = []
        handles: list[ActionHandle] = []
        seen: set[str] = set()
        for raw in actions:
            action = self._coerce(raw)
            if action.id in seen:
                raise ActionRejected(f"action id {action.id!r} appears twice in one submit")
            seen.add(action.id)
            meta = action_meta(action, now)
            self._check(action, meta)
            items.append(encode_action(action, meta, self._limits()))
            handles.append(ActionHandle(self, action.id, action.trajectory_id or ""))
        max_queued = int((self._view or {}).get("max_queued", 0))
        fraction = (
            self.config.broker.admit_memory_fraction
            if self.config
            else float((self._view or {}).get("admit_memory_fraction", 0.8))
        )
        self.store.submit(
            items, max_queued, ttl_s=self._limits().queued_ttl_s, admit_memory_fraction=fraction
        )
        return handles

    def handle(self, action_id: str, trajectory_id: str = "") -> ActionHandle:
        """A handle for an action submitted earlier, e.g. by a client process that died."""
        return ActionHandle(self, action_id, trajectory_id)

    async def run(self, action: AnyAction | dict[str, Any], timeout: float | None = 600.0) -> ActionResult:
        """Submit and await the result without blocking the event loop."""
        handle = self.submit(action)
        return await asyncio.get_running_loop().run_in_executor(None, handle.result, timeout)

    def close_trajectory(self, trajectory_id: str) -> None:
        """The trajectory is finished: its sandbox and reserved memory are released once its
        queued and running actions are done."""
        self.store.control({"control": "close", "trajectory_id": trajectory_id})

    def cancel(self, action_id: str, reason: str = "cancelled by its caller") -> bool:
        """Withdraw an action that no scheduler has dispatched yet. True: it will never run and
        its result has status `cancelled`. False: it was already dispatched (it runs to the
        end), finished, or is unknown."""
        state = self.store.retrying(
            "cancel", lambda: self.store.cancel(action_id, cancelled_result(action_id, reason))
        )
        return state == "cancelled"

    def close(self) -> None:
        self.store.close()

    def __enter__(self) -> TangramClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
