"""One scoring path for every remote-reward protocol (OpenRLHF, slime): a response is scored by
a scorer named in the URL, which is either

  * `code`: the label holds the problem's test cases (verl's ground-truth JSON); the code block
    of the response runs against all of them as ONE action on an elastic core range, and the
    reward is the fraction of cases passed; or
  * the name of a configured reward model: a rule verifier (`backend: rule`, a CPU action) or a
    model served on Triton (a GPU action, batched with others by the scheduler); the reward is
    the model's `score`.

Every score is an action under the HTTP server's deadlines (`Gate`).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from tangram_celery.client.gate import Gate, Late, Overloaded
from tangram_celery.common.actions import ActionStatus, CodeAction, RewardAction
from tangram_celery.common.admission import AnyAction
from tangram_celery.common.config import TangramConfig
from tangram_celery.common.wire import ActionResult
from tangram_celery.integrations.code_tests import extract_code, parse_ground_truth, to_test_cases

CODE_SCORER = "code"
# how each reward backend kind takes (prompt, response, label)
_INPUTS: dict[str, tuple[str, ...]] = {
    "rule": ("response", "reference"),
    "embedding-sim": ("response", "reference"),
    "hf-seq-cls": ("prompt", "response"),
    "teacher-logprobs": ("prompt", "response"),
}


class ScoringError(ValueError):
    """The request cannot be scored as given (unknown scorer, malformed label)."""


class ScoringOverloaded(Exception):
    """The scoring action could not start in time (nothing ran)."""


@dataclass
class Score:
    reward: float
    extra: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class ScoreSettings:
    code_cpus: str = "1..4"
    code_timeout_s: float = 30.0
    code_memory_mb: int = 1024
    job_id: str = "default"


def scorers(cfg: TangramConfig) -> list[str]:
    return [CODE_SCORER, *(m.name for m in cfg.reward_models)]


def scoring_action(
    cfg: TangramConfig,
    scorer: str,
    prompt: str,
    response: str,
    label: Any,
    s: ScoreSettings,
    trajectory_id: str | None,
) -> AnyAction:
    """The action that scores one response (raises ScoringError)."""
    if scorer == CODE_SCORER:
        code = extract_code(response)
        if code is None:
            raise _NoCode()
        try:
            code, cases = to_test_cases(code, parse_ground_truth(label))
        except (ValueError, TypeError) as e:
            raise ScoringError(f"label: {e}") from None
        return CodeAction(
            trajectory_id=trajectory_id,
            code=code,
            test_cases=cases,
            cpus=s.code_cpus,
            timeout_s=s.code_timeout_s,
            memory_mb=s.code_memory_mb,
            job_id=s.job_id,
        )
    model = cfg.reward_model(scorer)
    if model is None:
        raise ScoringError(f"unknown scorer {scorer!r}; this deployment has {scorers(cfg)}")
    values = {"prompt": prompt, "response": response, "reference": "" if label is None else str(label)}
    inputs = {k: values[k] for k in _INPUTS[model.backend]}
    return RewardAction(trajectory_id=trajectory_id, model=scorer, inputs=inputs, job_id=s.job_id)


class _NoCode(Exception):
    pass


def reward_of(result: ActionResult) -> Score:
    info: dict[str, Any] = {"status": str(result.status), "action_id": result.action_id}
    if result.tests:
        passed = sum(t.passed for t in result.tests)
        info.update(passed=passed, total=len(result.tests))
        return Score(passed / len(result.tests), info)
    if result.status is ActionStatus.OK and isinstance(result.output, dict) and "score" in result.output:
        return Score(float(result.output["score"]), info)
    info["error"] = result.error or result.stderr[-500:]
    return Score(0.0, info)


async def score(
    gate: Gate, cfg: TangramConfig, scorer: str, prompt: str, response: str, label: Any, s: ScoreSettings
) -> Score:
    """Score one response. Raises ScoringError (bad request) or ScoringOverloaded (not run)."""
    t0 = time.monotonic()

    def make(trajectory_id: str | None) -> AnyAction:
        return scoring_action(cfg, scorer, prompt, response, label, s, trajectory_id)

    try:
        probe = make("one-shot")  # validated before anything is enqueued
    except _NoCode:
        return Score(0.0, {"status": "no_code", "error": "the response has no ``` code block"})
    budget = probe.timeout_s
    outcome = await gate.run_one_shot(
        lambda tid: probe.model_copy(update={"trajectory_id": tid}), t0=t0, budget_s=budget
    )
    if isinstance(outcome, Overloaded):
        raise ScoringOverloaded(outcome.reason)
    if isinstance(outcome, Late):
        return Score(0.0, {"status": "deadline", "action_id": outcome.action_id})
    return reward_of(outcome)
