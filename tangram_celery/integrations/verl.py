"""verl adapters: a custom reward function and a multi-turn code tool, both over Tangram's HTTP API.

Zero code: verl's own sandbox reward talks to `tangram serve` as it talks to SandboxFusion,
`reward.sandbox_fusion.url=http://HOST:PORT/run_code` (one request per test case).

Custom reward function (one Tangram action per problem: compiled once, all cases in parallel on
an elastic core range):

    reward.custom_reward_function.path=pkg://tangram_celery.integrations.verl
    reward.custom_reward_function.name=compute_score          # or compute_score_sync
    +reward.custom_reward_function.reward_kwargs.tangram_url=http://HOST:PORT

Multi-turn tool (`rollout.multi_turn.tool_config_path`, class_name
`tangram_celery.integrations.verl.TangramCodeTool`): files persist across the calls of one
rollout (keyed by verl's `request_id`), in that trajectory's sandbox.

Nothing from verl is imported until `TangramCodeTool` is first used.
"""

from __future__ import annotations

import asyncio
import json
import os
import time
import urllib.error
import urllib.request
from typing import Any

from tangram_celery.common.actions import LANGUAGES
from tangram_celery.integrations.code_tests import extract_code, parse_ground_truth, to_test_cases

URL_ENV = "TANGRAM_URL"  # default server URL when no tangram_url is given
TOKEN_ENV = "TANGRAM_HTTP_TOKEN"
RETRY_DELAYS_S = (1.0, 2.0, 4.0)  # after an overload answer (the action did not run)


def _url(tangram_url: str | None) -> str:
    url = tangram_url or os.environ.get(URL_ENV)
    if not url:
        raise ValueError(f"pass tangram_url=http://HOST:PORT (reward_kwargs) or set {URL_ENV}")
    return url.rstrip("/").removesuffix("/run_code")


def _headers(token: str | None) -> dict[str, str]:
    token = token or os.environ.get(TOKEN_ENV)
    h = {"Content-Type": "application/json"}
    if token:
        h["Authorization"] = f"Bearer {token}"
    return h


def run_tests_body(
    solution_str: str,
    ground_truth: Any,
    *,
    language: str = "python",
    cpus: str | int = "1..4",
    timeout_s: float = 30.0,
    memory_mb: int = 1024,
    job_id: str = "default",
) -> dict[str, Any] | None:
    """The /tangram/v1/run_tests body scoring one completion, or None if it has no code block.
    Raises ValueError on malformed test cases."""
    code = extract_code(solution_str)
    if code is None:
        return None
    code, cases = to_test_cases(code, parse_ground_truth(ground_truth))
    return {
        "code": code,
        "language": language,
        "cases": [c.model_dump(exclude_none=True) for c in cases],
        "cpus": cpus,
        "timeout_s": timeout_s,
        "memory_mb": memory_mb,
        "job_id": job_id,
    }


def score_of(reply: dict[str, Any]) -> dict[str, Any]:
    total = int(reply.get("total") or 0)
    passed = int(reply.get("passed") or 0)
    return {
        "score": passed / total if total else 0.0,
        "passed": passed,
        "total": total,
        "tangram_status": str(reply.get("status", "")),
    }


def _failed(why: str) -> dict[str, Any]:
    return {"score": 0.0, "passed": 0, "total": 0, "tangram_status": why}


async def compute_score(
    data_source: str,
    solution_str: str,
    ground_truth: Any,
    extra_info: dict[str, Any] | None = None,
    *,
    tangram_url: str | None = None,
    token: str | None = None,
    language: str = "python",
    cpus: str | int = "1..4",
    timeout_s: float = 30.0,
    memory_mb: int = 1024,
    job_id: str = "default",
    **kwargs: Any,
) -> dict[str, Any]:
    """verl custom reward (async): the fraction of the problem's test cases the completion's
    code passes, all cases in ONE Tangram action. Returns {"score", "passed", "total",
    "tangram_status"}; the extra keys become verl's reward_extra_info."""
    try:
        body = run_tests_body(
            solution_str,
            ground_truth,
            language=language,
            cpus=cpus,
            timeout_s=timeout_s,
            memory_mb=memory_mb,
            job_id=job_id,
        )
    except ValueError as e:
        return _failed(f"bad_tests: {e}")
    if body is None:
        return _failed("no_code")
    import aiohttp  # a verl dependency; imported here so that loading this module needs nothing

    url = _url(tangram_url) + "/tangram/v1/run_tests"
    http_timeout = aiohttp.ClientTimeout(total=timeout_s + 60.0)
    async with aiohttp.ClientSession(timeout=http_timeout, headers=_headers(token)) as session:
        for delay in (*RETRY_DELAYS_S, None):
            try:
                async with session.post(url, data=json.dumps(body)) as resp:
                    if resp.status in (429, 503, 504) and delay is not None:
                        await asyncio.sleep(delay)
                        continue
                    reply = await resp.json(content_type=None)
                    if resp.status != 200:
                        return _failed(f"http_{resp.status}: {str(reply)[:200]}")
                    return score_of(reply)
            except (aiohttp.ClientError, TimeoutError, ValueError) as e:
                return _failed(f"request_failed: {e}")
    return _failed("overloaded")


def compute_score_sync(
    data_source: str,
    solution_str: str,
    ground_truth: Any,
    extra_info: dict[str, Any] | None = None,
    *,
    tangram_url: str | None = None,
    token: str | None = None,
    language: str = "python",
    cpus: str | int = "1..4",
    timeout_s: float = 30.0,
    memory_mb: int = 1024,
    job_id: str = "default",
    **kwargs: Any,
) -> dict[str, Any]:
    """The synchronous twin of `compute_score` (verl's `remote` reward manager rejects async
    functions); standard library only."""
    try:
        body = run_tests_body(
            solution_str,
            ground_truth,
            language=language,
            cpus=cpus,
            timeout_s=timeout_s,
            memory_mb=memory_mb,
            job_id=job_id,
        )
    except ValueError as e:
        return _failed(f"bad_tests: {e}")
    if body is None:
        return _failed("no_code")
    url = _url(tangram_url) + "/tangram/v1/run_tests"
    data = json.dumps(body).encode()
    for delay in (*RETRY_DELAYS_S, None):
        req = urllib.request.Request(url, data=data, headers=_headers(token), method="POST")
        try:
            with urllib.request.urlopen(req, timeout=timeout_s + 60.0) as resp:
                return score_of(json.loads(resp.read()))
        except urllib.error.HTTPError as e:
            if e.code in (429, 503, 504) and delay is not None:
                time.sleep(delay)
                continue
            return _failed(f"http_{e.code}: {e.read()[:200]!r}")
        except (urllib.error.URLError, TimeoutError, ValueError) as e:
            return _failed(f"request_failed: {e}")
    return _failed("overloaded")


# ---- multi-turn code tool ------------------------------------------------------------------------
TOOL_SCHEMA: dict[str, Any] = {
    "type": "function",
    "function": {
        "name": "code_interpreter",
        "description": "Run a program in a sandbox; files written persist across calls of this conversation.",
        "parameters": {
            "type": "object",
            "properties": {
                "code": {"type": "string", "description": "the program"},
                "language": {
                    "type": "string",
                    "description": "the program's language (those the deployment runs; see /v1/capabilities)",
                    "enum": list(LANGUAGES),
                },
                "stdin": {"type": "string", "description": "standard input"},
            },
            "required": ["code"],
        },
    },
}


class CodeToolCore:
    """What the verl tool does, without verl: one `/run_code` call per tool call, in the
    trajectory of the rollout (`agent_data.request_id`), so files persist across calls.

    verl's tool agent loop creates and releases a tool instance around every single call, so
    state cannot live in the instance: it lives in Tangram's trajectory sandbox, which Tangram
    releases when idle (the rollout's end is not signalled to tools)."""

    def __init__(self, config: dict[str, Any]) -> None:
        self.url = _url(config.get("tangram_url"))
        self.token = config.get("token")
        self.run_timeout_s = float(config.get("run_timeout_s", 10.0))
        self.memory_mb = int(config.get("memory_mb", 1024))
        self.max_output_chars = int(config.get("max_output_chars", 4000))
        self.job_id = str(config.get("job_id", "default"))
        self._own: dict[str, str] = {}  # instance id -> trajectory, when verl gives no request_id

    def trajectory_of(self, instance_id: str, kwargs: dict[str, Any]) -> str:
        agent_data = kwargs.get("agent_data")
        request_id = getattr(agent_data, "request_id", None) or kwargs.get("request_id")
        raw = str(request_id) if request_id else self._own.setdefault(instance_id, instance_id)
        safe = "".join(c if c.isalnum() or c in "_.:-" else "-" for c in raw)[:120]
        return f"verl-{safe}"

    async def run(
        self, instance_id: str, parameters: dict[str, Any], **kwargs: Any
    ) -> tuple[str, dict[str, Any]]:
        """(text for the model, metrics) of one call."""
        import aiohttp

        body = {
            "code": str(parameters.get("code", "")),
            "language": str(parameters.get("language") or "python"),
            "stdin": parameters.get("stdin"),
            "run_timeout": self.run_timeout_s,
            "compile_timeout": self.run_timeout_s,
            "memory_limit_MB": self.memory_mb,
            "trajectory_id": self.trajectory_of(instance_id, kwargs),
            "job_id": self.job_id,
        }
        timeout = aiohttp.ClientTimeout(total=2 * self.run_timeout_s + 60.0)
        async with aiohttp.ClientSession(timeout=timeout, headers=_headers(self.token)) as session:
            for delay in (*RETRY_DELAYS_S, None):
                async with session.post(self.url + "/run_code", data=json.dumps(body)) as resp:
                    if resp.status in (429, 503, 504) and delay is not None:
                        await asyncio.sleep(delay)
                        continue
                    reply = await resp.json(content_type=None)
                    if resp.status != 200:
                        return f"sandbox unavailable (HTTP {resp.status})", {"tangram_status": "unavailable"}
                    return self._text(reply), {
                        "tangram_status": (reply.get("tangram") or {}).get("status", "")
                    }
        return "sandbox overloaded", {"tangram_status": "overloaded"}

    def _text(self, reply: dict[str, Any]) -> str:
        parts = []
        for phase in ("compile_result", "run_result"):
            r = reply.get(phase) or {}
            for stream in ("stdout", "stderr"):
                if r.get(stream):
                    parts.append(f"[{phase.split('_')[0]} {stream}]\n{r[stream]}")
        status = (reply.get("tangram") or {}).get("status") or reply.get("status")
        text = "\n".join(parts) or "(no output)"
        if status not in ("ok", "Success"):
            text += f"\n[status: {status}] {reply.get('message', '')}".rstrip()
        if len(text) > self.max_output_chars:
            text = text[: self.max_output_chars] + "\n...(truncated)"
        return text


def _make_tool_class() -> type:
    from verl.tools.base_tool import BaseTool
    from verl.tools.schemas import OpenAIFunctionToolSchema, ToolResponse

    class TangramCodeTool(BaseTool):
        """verl BaseTool running code in Tangram; files persist per rollout (request_id)."""

        def __init__(self, config: dict[str, Any], tool_schema: Any = None) -> None:
            schema = tool_schema or OpenAIFunctionToolSchema.model_validate(TOOL_SCHEMA)
            super().__init__(config, schema)
            self.core = CodeToolCore(config)

        async def execute(self, instance_id: str, parameters: dict[str, Any], **kwargs: Any) -> Any:
            text, metrics = await self.core.run(instance_id, parameters, **kwargs)
            return ToolResponse(text=text), 0.0, metrics

    return TangramCodeTool


_TOOL: type | None = None


def __getattr__(name: str) -> Any:
    """`TangramCodeTool` is built (and verl imported) on first access."""
    global _TOOL
    if name == "TangramCodeTool":
        if _TOOL is None:
            _TOOL = _make_tool_class()
        return _TOOL
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
