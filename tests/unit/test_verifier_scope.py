"""The CPU worker names the verifier group of each action's tests from `sandbox.verifier_scope`
(what the sandbox does with it: tests/integration/test_sandbox_recycle.py)."""

from __future__ import annotations

from typing import Any

import pytest

from tangram_celery.common.actions import ActionStatus, CodeAction
from tangram_celery.common.config import SandboxConfig
from tangram_celery.common.wire import TaskOrder
from tangram_celery.sandbox import ExecRequest, ExecResult
from tangram_celery.workers.cpu import CpuHandler


class Recorder:
    """Stands in for the sandbox: keeps the requests the handler builds."""

    name = "recorder"

    def __init__(self) -> None:
        self.requests: list[ExecRequest] = []

    def run(self, trajectory_id: str, request: ExecRequest) -> ExecResult:
        self.requests.append(request)
        return ExecResult(status=ActionStatus.OK)

    run_once = lambda self, request: self.run("", request)  # noqa: E731


@pytest.mark.parametrize(
    ("scope", "action", "group"),
    [
        (None, {"trajectory_id": "t", "job_id": "grpo-7"}, "job:grpo-7"),
        ("job", {"trajectory_id": "t"}, "job:default"),
        ("job", {"job_id": "eval"}, "job:eval"),  # one-shot
        ("occupant", {"trajectory_id": "t", "job_id": "grpo-7"}, ""),
    ],
)
def test_the_handler_names_the_job_as_verifier_group_unless_the_scope_is_the_occupant(
    scope: str | None, action: dict[str, Any], group: str
) -> None:
    """Given the default scope or `job`, an action's tests may share verifiers with later
    occupants of its job (`job:<job_id>`); given `occupant`, with none ("")."""
    cfg = SandboxConfig.model_validate(
        {"backend": "namespace", **({"verifier_scope": scope} if scope else {})}
    )
    box = Recorder()
    order = TaskOrder(action_id="a", kind="cpu", pool="n0", units=1, unit_ids=(0,))
    res = CpuHandler(box, cfg)("a", CodeAction(code="pass", **action).model_dump(mode="json"), order)  # type: ignore[arg-type]
    assert res.status is ActionStatus.OK and [r.verifier_group for r in box.requests] == [group]


def test_a_verifier_scope_other_than_job_or_occupant_is_refused() -> None:
    with pytest.raises(ValueError, match="verifier_scope"):
        SandboxConfig.model_validate({"verifier_scope": "trajectory"})
