"""Admitting an action: the one check both clients (sync and async) make before enqueuing.

`admit` validates an action against the deployment and encodes what goes to Redis: the
deployment's payload caps (`payload_errors`; `limits` in the config, published with the pool
view so that a client without the config file applies the same ones; sizes are UTF-8 bytes),
whether it can run here at all (`PoolView.refusal`, the check the scheduler makes again at
intake), and a reward model's inputs. The action models themselves validate shape (types,
path rules, a hard nesting ceiling).
"""

from __future__ import annotations

from typing import Any, NamedTuple

from pydantic import TypeAdapter, ValidationError

from tangram_celery.common.actions import (
    Action,
    ActionStatus,
    ApiAction,
    CodeAction,
    RewardAction,
    json_depth,
)
from tangram_celery.common.config import LimitsConfig
from tangram_celery.common.errors import ActionRejected
from tangram_celery.common.reward_inputs import input_errors
from tangram_celery.common.wire import ActionMeta, ActionResult, PoolView

AnyAction = CodeAction | RewardAction | ApiAction
# how long a client trusts the languages the CPU workers reported (a worker starting later, or
# restarted with other toolchains, is seen this much later)
LANGUAGES_TTL_S = 2.0
_ACTION: TypeAdapter[AnyAction] = TypeAdapter(Action)


class SubmitItem(NamedTuple):
    """One admitted action as the submit script takes it."""

    action_id: str
    meta_json: str
    payload_json: str


def coerce_action(action: AnyAction | dict[str, Any]) -> AnyAction:
    """The action model for a dict (validated), or the model itself; ActionRejected if invalid."""
    if isinstance(action, CodeAction | RewardAction | ApiAction):
        return action
    try:
        return _ACTION.validate_python(action)
    except ValidationError as e:
        raise ActionRejected(f"invalid action: {e}") from None


def admit(action: AnyAction, view: PoolView | None, limits: LimitsConfig, submitted_s: float) -> SubmitItem:
    """Check `action` and encode it, or raise ActionRejected saying why.

    `view` None: no scheduler has published its pools yet (it checks at intake)."""
    too_big = payload_errors(action, limits)
    if too_big:
        raise ActionRejected(f"action {action.id} rejected: too large: " + "; ".join(too_big))
    meta = ActionMeta.of(action, submitted_s)
    if view is not None:
        why = view.refusal(meta)
        if why is None and isinstance(action, RewardAction):
            errors = input_errors(view.models[action.model].backend, action.inputs)
            why = f"inputs for {action.model!r}: " + "; ".join(errors) if errors else None
        if why is not None:
            raise ActionRejected(f"action {action.id} rejected: {why}")
    payload = action.model_dump_json()
    size = len(payload.encode())
    if size > limits.max_payload_bytes:
        raise ActionRejected(
            f"action {action.id} rejected: {size} bytes as JSON > "
            f"{limits.max_payload_bytes} (limits.max_payload_bytes)"
        )
    return SubmitItem(action.id, meta.dumps(), payload)


def cancelled_result(action_id: str, reason: str) -> str:
    """The stored result of an action cancelled before it ran (JSON)."""
    return ActionResult(
        action_id=action_id,
        status=ActionStatus.CANCELLED,
        error=f"cancelled before it ran: {reason}",
        attempts=0,
    ).model_dump_json()


def _b(text: str | None) -> int:
    return 0 if text is None else len(text.encode("utf-8", "surrogatepass"))


def payload_errors(action: CodeAction | RewardAction | ApiAction, limits: LimitsConfig) -> list[str]:
    """Every cap `action` exceeds, each as 'what: size > cap (limits.key)'; [] when it fits."""
    out: list[str] = []

    def cap(what: str, size: int, key: str) -> None:
        limit = int(getattr(limits, key))
        if size > limit:
            out.append(f"{what}: {size} > {limit} (limits.{key})")

    if isinstance(action, CodeAction):
        cap("code bytes", _b(action.code), "max_code_bytes")
        cap("stdin bytes", _b(action.stdin), "max_stdin_bytes")
        cap("files entries", len(action.files) + len(action.binary_files), "max_files")
        files_b = sum(_b(c) for c in action.files.values())
        files_b += sum(len(c) * 3 // 4 for c in action.binary_files.values())  # decoded size
        cap("files bytes", files_b, "max_files_bytes")
        cap("test cases", len(action.test_cases), "max_test_cases")
        for t in action.test_cases:
            for field in ("stdin", "expected_stdout", "assert_code"):
                size = _b(getattr(t, field))
                if size > limits.max_test_field_bytes:
                    cap(f"test {t.name!r} {field} bytes", size, "max_test_field_bytes")
                    break
    elif isinstance(action, RewardAction):
        cap("inputs nesting depth", json_depth(action.inputs), "max_json_depth")
    else:
        cap("request nesting depth", json_depth(action.request), "max_json_depth")
    return out


def limits_from_view(view: PoolView | None) -> LimitsConfig:
    """The caps a scheduler published (defaults when none has yet)."""
    return view.limits if view is not None else LimitsConfig()
