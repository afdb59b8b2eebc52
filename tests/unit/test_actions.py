"""Action validation and cost derivation."""

import pytest
from pydantic import ValidationError

from scheduler.model import ResourceKind
from scheduler.service.cluster import to_queued
from tangram_celery.common.actions import ApiAction, CodeAction, RewardAction, TestCase, stored_action
from tangram_celery.common.config import parse_config
from tangram_celery.common.wire import ActionMeta, PoolView

action_meta = ActionMeta.of


CFG = parse_config(
    {
        "nodes": {
            "cpu": [{"name": "n0", "cores": 8, "numa_groups": 2, "memory_mb": 4096}],
            "gpu": [{"name": "g0", "num_gpus": 4, "gpu_memory_mb": 16000}],
        },
        "apis": [{"name": "calc", "handler": "m:f", "max_concurrency": 2}],
        "reward_models": [
            {"name": "rm", "backend": "hf-seq-cls", "path": "/m", "dop_options": [1, 2], "memory_mb": 900}
        ],
    }
)


def test_code_action_elastic_cpus_become_a_range() -> None:
    """Given cpus '1..8' on a node with 4-core NUMA groups, the cost range is capped at 4."""
    a = CodeAction(trajectory_id="t", code="print(1)", cpus="1..8", test_command="pytest")
    qa = to_queued(action_meta(a, 0.0), CFG)
    assert qa.cost.key is ResourceKind.CPU
    assert qa.cost.units.units == (1, 2, 3, 4)
    assert qa.kind == "tests"


def test_reward_cost_uses_model_dop_and_memory() -> None:
    """A reward action costs the model's DoP options and GPU memory."""
    qa = to_queued(action_meta(RewardAction(trajectory_id="t", model="rm", inputs={"x": 1}), 0.0), CFG)
    assert qa.cost.key is ResourceKind.GPU and qa.cost.units.units == (1, 2)
    assert qa.cost.gpu_memory_mb == 900 and qa.target == "rm"


@pytest.mark.parametrize(
    "kwargs",
    [
        {"cpus": "4..2", "code": "x"},
        {"cpus": 0, "code": "x"},
        {"language": "cobol", "code": "x"},
        {},  # nothing to run
        {"code": "x", "files": {"../escape.py": ""}},
        {"code": "x", "files": {"a\x00b": ""}},
        {"code": "x", "files": {"./a.py": ""}},
        {"code": "x", "files": {"a/./b.py": ""}},
        {"code": "x", "files": {"dir/": ""}},
        {"code": "x", "files": {"a//b": ""}},
        {"code": "x", "files": {"": ""}},
        {"code": "x", "files": {"/etc/passwd": ""}},
        {"code": "x", "files": {"a\nb": ""}},
        {"code": "x", "timeout_s": -1},
        {"code": "x", "bogus": 1},
    ],
)
def test_invalid_code_actions_are_refused(kwargs: dict[str, object]) -> None:
    """Malformed code actions fail validation when built."""
    with pytest.raises(ValidationError):
        CodeAction(trajectory_id="t", **kwargs)


def test_test_case_needs_exactly_one_check() -> None:
    """A test case is either stdin->stdout or an assert snippet."""
    with pytest.raises(ValidationError):
        TestCase(name="t")
    with pytest.raises(ValidationError):
        TestCase(name="t", expected_stdout="1", assert_code="assert 1")


def test_a_stored_action_is_typed_again_without_the_submit_checks() -> None:
    """Given a payload its client stored after the submit's checks, when the worker reads it,
    then it is the same typed action; the user-input checks (paths, base64, nesting) ran once,
    at submit, and a direct build still runs them."""
    action = CodeAction(
        id="a", trajectory_id="t", code="x", files={"a.py": "1"}, binary_files={"b": "AAAA"}, cpus="1..2"
    )
    assert stored_action(action.model_dump(mode="json")) == action
    reward = RewardAction(id="r", model="rm", inputs={"prompt": "p"})
    assert stored_action(reward.model_dump(mode="json")) == reward
    bad = {**action.model_dump(mode="json"), "binary_files": {"b": "not base64!"}}
    assert isinstance(stored_action(bad), CodeAction)  # not checked again
    with pytest.raises(ValidationError):
        CodeAction.model_validate(bad)


def test_the_pool_view_refuses_what_can_never_run() -> None:
    """Unknown model/API and cpus beyond every NUMA group are refused with a reason."""
    view = PoolView.of(CFG)
    assert "unknown reward model" in str(
        view.refusal(action_meta(RewardAction(trajectory_id="t", model="zz", inputs={}), 0))
    )
    assert "unknown API" in str(view.refusal(action_meta(ApiAction(trajectory_id="t", api="zz"), 0)))
    assert "NUMA" in str(view.refusal(action_meta(CodeAction(trajectory_id="t", code="x", cpus=5), 0)))
    assert view.refusal(action_meta(CodeAction(trajectory_id="t", code="x", cpus="1..64"), 0)) is None


def test_admission_rejects_malformed_reward_inputs_before_enqueue() -> None:
    """A reward action whose inputs do not fit its model's backend is refused at admission (the
    check both clients make); a fitting one is admitted with its metadata."""
    from tangram_celery.common.admission import admit
    from tangram_celery.common.errors import ActionRejected

    view = PoolView.of(CFG)
    bad = RewardAction(trajectory_id="t", model="rm", inputs={"colour": "blue"})
    with pytest.raises(ActionRejected, match="inputs for 'rm'"):
        admit(bad, view, CFG.limits, 0.0)
    good = RewardAction(trajectory_id="t", model="rm", inputs={"prompt": "2+2?", "response": "4"})
    item = admit(good, view, CFG.limits, 0.0)
    assert ActionMeta.model_validate_json(item.meta_json) == action_meta(good, 0.0)


def _deep(n: int) -> object:
    v: object = 1
    for _ in range(n):
        v = {"k": [v]}
    return v


def test_deeply_nested_requests_are_rejected_at_submit_not_in_serialisation() -> None:
    """An API request or reward inputs nested 300 levels deep is an ActionRejected with a reason
    (not a serialiser's recursion error); 50 levels pass the model and exceed the default cap."""
    from tangram_celery.common.admission import coerce_action, payload_errors
    from tangram_celery.common.errors import ActionRejected

    with pytest.raises(ActionRejected, match="nested deeper"):
        coerce_action({"type": "api", "trajectory_id": "t", "api": "calc", "request": {"x": _deep(300)}})
    ok = ApiAction(trajectory_id="t", api="calc", request={"x": _deep(40)})
    assert "request nesting depth: 81 > 64" in payload_errors(ok, CFG.limits)[0]


def test_payload_caps_count_bytes_and_name_the_limit() -> None:
    """Code is capped in UTF-8 bytes (not characters); stdin, the number and size of files and
    each test case's fields are capped too; each refusal names the `limits.` key to raise."""
    from tangram_celery.common.admission import payload_errors
    from tangram_celery.common.config import LimitsConfig

    lim = LimitsConfig(max_code_bytes=1024, max_stdin_bytes=10, max_files=2, max_test_field_bytes=1024)
    wide = "\u00e9" * 600  # 600 characters, 1200 bytes
    errs = payload_errors(CodeAction(trajectory_id="t", code=wide), lim)
    assert errs == ["code bytes: 1200 > 1024 (limits.max_code_bytes)"]
    errs = payload_errors(
        CodeAction(
            trajectory_id="t",
            code="x",
            stdin="x" * 11,
            files={"a": "", "b": "", "c": ""},
            test_cases=[TestCase(name="t1", expected_stdout="y" * 2000)],
        ),
        lim,
    )
    assert {e.split(" (limits.")[1] for e in errs} == {
        "max_stdin_bytes)",
        "max_files)",
        "max_test_field_bytes)",
    }
    assert payload_errors(CodeAction(trajectory_id="t", code="x" * 1024), lim) == []
