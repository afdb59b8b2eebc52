"""Remote reward endpoints served by `tangram serve`, one per framework protocol, one scoring path
(`scoring.py`); the scorer is the last part of the URL (`code` or a reward model's name).

  OpenRLHF  `--remote_rm_url http://HOST:PORT/tangram/v1/openrlhf/SCORER`
            POST {"query": [...], "prompts": [...], "labels": [...]}
            -> {"rewards": [...], "scores": [...], "extra_logs": {...}}
  slime     `--rm-type remote_rm --rm-url http://HOST:PORT/tangram/v1/slime/SCORER`
            POST {"prompt": ..., "response": ..., "label": ...} -> the reward (a JSON number)

When a score cannot start in time the whole request gets the overload status (both frameworks
retry failed requests); nothing of it ran.
"""

from __future__ import annotations

import asyncio
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field

from tangram_celery.client.gate import Gate
from tangram_celery.integrations.scoring import Score, ScoreSettings, ScoringError, ScoringOverloaded, score

router = APIRouter(prefix="/tangram/v1", tags=["rewards"])
SCORER = r"^[a-z0-9][a-z0-9_.-]{0,62}$"
MAX_BATCH = 4096


class OpenRLHFRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")  # the framework's protocol, not ours

    query: list[str] = Field(max_length=MAX_BATCH, description="prompt + response, as decoded")
    prompts: list[str] = Field(default_factory=list, max_length=MAX_BATCH)
    labels: list[Any] = Field(default_factory=list, max_length=MAX_BATCH)


class OpenRLHFResponse(BaseModel):
    rewards: list[float]
    scores: list[float]
    extra_logs: dict[str, list[float]]


class SlimeRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")

    prompt: Any = Field(None, description="text, or chat messages ({role, content})")
    response: str
    label: Any = None


def _text(prompt: Any) -> str:
    if isinstance(prompt, list):
        return "\n".join(str(m.get("content", "")) if isinstance(m, dict) else str(m) for m in prompt)
    return "" if prompt is None else str(prompt)


def _overloaded(gate: Gate, why: str) -> JSONResponse:
    return JSONResponse({"detail": why}, status_code=gate.cfg.overload_status, headers={"Retry-After": "1"})


async def _score_all(
    request: Request, scorer: str, items: list[tuple[str, str, Any]]
) -> list[Score] | JSONResponse:
    state = request.app.state.tangram
    gate: Gate = state.gate_of(request.scope)  # the tenant the request acts as
    if not gate.admit():
        return _overloaded(gate, f"more than {gate.cfg.max_in_flight} requests in flight")
    try:
        settings = ScoreSettings(code_memory_mb=state.default_memory_mb)
        return list(
            await asyncio.gather(
                *(score(gate, state.cfg, scorer, p, r, lbl, settings) for p, r, lbl in items)
            )
        )
    except ScoringOverloaded as e:
        return _overloaded(gate, str(e))
    except ScoringError as e:
        return JSONResponse({"detail": str(e)}, status_code=400)
    finally:
        gate.leave()


@router.post("/openrlhf/{scorer}", response_model=OpenRLHFResponse)
async def openrlhf(scorer: str, body: OpenRLHFRequest, request: Request) -> OpenRLHFResponse | JSONResponse:
    """OpenRLHF's remote reward model protocol."""
    if not _valid(scorer):
        return JSONResponse({"detail": f"bad scorer name {scorer!r}"}, status_code=400)
    items = []
    for i, query in enumerate(body.query):
        prompt = body.prompts[i] if i < len(body.prompts) else ""
        response = query[len(prompt) :] if prompt and query.startswith(prompt) else query
        items.append((prompt, response, body.labels[i] if i < len(body.labels) else None))
    scores = await _score_all(request, scorer, items)
    if isinstance(scores, JSONResponse):
        return scores
    rewards = [s.reward for s in scores]
    logs = {
        "tangram_ok": [1.0 if s.extra.get("status") == "ok" else 0.0 for s in scores],
        "tangram_passed": [float(s.extra.get("passed", 0)) for s in scores],
    }
    return OpenRLHFResponse(rewards=rewards, scores=rewards, extra_logs=logs)


@router.post("/slime/{scorer}", response_model=float)
async def slime(scorer: str, body: SlimeRequest, request: Request) -> float | JSONResponse:
    """slime's remote reward protocol: the reply is the reward."""
    if not _valid(scorer):
        return JSONResponse({"detail": f"bad scorer name {scorer!r}"}, status_code=400)
    scores = await _score_all(request, scorer, [(_text(body.prompt), body.response, body.label)])
    if isinstance(scores, JSONResponse):
        return scores
    return scores[0].reward


def _valid(scorer: str) -> bool:
    import re

    return re.match(SCORER, scorer) is not None
