"""The soak's bookkeeping, kept pure so that it can be tested on synthetic logs (benchmarks/soak.py).

An `Expected` says what one action must come back with (its status, exact stdout and test
verdicts for code, exact score for a rule reward, the tag for the recording API). From the
client's results, the scheduler's run log (`actions.jsonl`, one record per completion), the
recording API's execution log (one line per execution) and the in-flight snapshots taken just
before each kill, `summarize` counts per kind: completed, lost, wrong, duplicated completions
(two run-log records, or a second result pushed to the client), duplicated executions (the API's
side effect done twice), the attempts histogram, and for every kill what was in flight on the
killed process and what became of it.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

KINDS = ("code", "reward", "api")
VICTIMS = ("scheduler", "worker-cpu-n0", "worker-api-rec", "redis")
FATES = ("retried", "completed", "lost", "wrong")
# what a kill of each victim hits: actions running on it (a worker), or every action in flight
# (the scheduler holds the waiting queue and every dispatch record; Redis holds all state)
LOG_FLUSH_WINDOW_S = 3.0  # a completion this long before a scheduler kill may miss the run log
WORKER_PREFIX = {"worker-cpu-n0": "cpu-n0@", "worker-api-rec": "api-rec@"}


@dataclass(frozen=True)
class Expected:
    """What one action must return. `tests`: test name -> passed; `score` for a rule reward,
    `tag` for the recording API."""

    kind: str
    status: str = "ok"
    stdout: str | None = None
    tests: Mapping[str, bool] = field(default_factory=dict)
    score: float | None = None
    tag: str | None = None


def verify(exp: Expected, result: Mapping[str, Any]) -> str | None:
    """Why `result` (an ActionResult as a dict) is wrong for `exp`, or None if it is right."""
    status = str(result.get("status"))
    if status != exp.status:
        return f"status {status!r} (expected {exp.status!r}): {str(result.get('error', ''))[:200]}"
    if exp.kind == "code":
        if exp.stdout is not None and result.get("stdout") != exp.stdout:
            return f"stdout {str(result.get('stdout'))[:80]!r} (expected {exp.stdout[:80]!r})"
        got = {t["name"]: bool(t["passed"]) for t in result.get("tests") or []}
        if got != dict(exp.tests):
            return f"tests {got} (expected {dict(exp.tests)})"
        return None
    output = result.get("output")
    if exp.kind == "reward":
        score = output.get("score") if isinstance(output, dict) else None
        if score is None or exp.score is None or abs(float(score) - exp.score) > 1e-9:
            return f"score {score!r} (expected {exp.score!r})"
        return None
    if exp.kind == "api":
        tag = output.get("tag") if isinstance(output, dict) else None
        if tag != exp.tag:
            return f"api answer {output!r} (expected tag {exp.tag!r})"
        return None
    return f"unknown kind {exp.kind!r}"


@dataclass(frozen=True)
class InFlight:
    """An action in flight when a kill came: its state in Redis just before (queued, dispatched,
    running), the worker that had claimed it, and its attempt."""

    action_id: str
    kind: str
    state: str
    worker: str
    attempt: int


@dataclass
class Kill:
    t_s: float
    victim: str
    in_flight: list[InFlight] = field(default_factory=list)


def hit_by(kill: Kill) -> list[InFlight]:
    """The actions the kill hit: running (claimed) on the killed worker; for the scheduler or
    Redis, every action in flight."""
    prefix = WORKER_PREFIX.get(kill.victim)
    if prefix is None:
        return list(kill.in_flight)
    return [a for a in kill.in_flight if a.state == "running" and a.worker.startswith(prefix)]


def percentiles(xs: Sequence[float]) -> dict[str, float | None]:
    if not xs:
        return {"n": 0, "avg": None, "p50": None, "p90": None, "p99": None, "max": None}  # type: ignore[dict-item]
    s = sorted(xs)

    def q(p: float) -> float:
        return s[min(len(s) - 1, int(p * len(s)))]

    return {"n": len(s), "avg": sum(s) / len(s), "p50": q(0.5), "p90": q(0.9), "p99": q(0.99), "max": s[-1]}


def summarize(
    expected: Mapping[str, Expected],
    results: Mapping[str, Mapping[str, Any]],
    run_log: Iterable[Mapping[str, Any]],
    api_executions: Iterable[str],
    leftover_notifications: Mapping[str, int],
    kills: Sequence[Kill],
) -> dict[str, Any]:
    """Per-kind counts, the attempts histogram, the kills table (see the module doc).

    `expected`: every submitted action; `results`: the result each got (absent: lost), with
    `received_s` (when the client had it, on the kills' clock) added;
    `run_log`: the scheduler's completion records; `api_executions`: the tags the recording API
    wrote, one per execution; `leftover_notifications`: results left unread in an action's
    result list at the end. One can be left legitimately (the waiter read the result from the
    action's hash while the push was on its way); two mean it was completed twice.
    """
    scheduler_kills = [k.t_s for k in kills if k.victim == "scheduler"]

    def near_scheduler_kill(res: Mapping[str, Any]) -> bool:
        # the scheduler writes its log through a buffer flushed every second: the records of
        # completions it handled just before a SIGKILL are lost with it (not the results)
        t = res.get("received_s")
        return t is not None and any(k - LOG_FLUSH_WINDOW_S <= float(t) <= k + 1.0 for k in scheduler_kills)

    logged = Counter(str(r.get("action_id")) for r in run_log)
    log_attempts = {str(r.get("action_id")): int(r.get("attempt", 1)) for r in run_log}
    executed = Counter(api_executions)
    kinds: dict[str, dict[str, Any]] = {}
    wrong_examples: list[dict[str, str]] = []
    for kind in KINDS:
        ids = [i for i, e in expected.items() if e.kind == kind]
        done = [i for i in ids if i in results]
        wrong = {i: why for i in done if (why := verify(expected[i], results[i])) is not None}
        wrong_examples += [{"action_id": i, "why": w} for i, w in list(wrong.items())[:5]]
        attempts = Counter(int(results[i].get("attempts", 1)) for i in done)
        dup_completions = [i for i in ids if logged[i] > 1 or leftover_notifications.get(i, 0) > 1]
        dup_exec = [i for i in ids if executed[expected[i].tag or ""] > 1] if kind == "api" else []
        kinds[kind] = {
            "submitted": len(ids),
            "completed": len(done),
            "lost": len(ids) - len(done),
            "lost_ids": [i for i in ids if i not in results][:20],
            "verified": len(done) - len(wrong),
            "wrong": len(wrong),
            "statuses": dict(Counter(str(results[i].get("status")) for i in done)),
            "duplicated_completions": len(dup_completions),
            "duplicated_executions": len(dup_exec) if kind == "api" else None,
            "duplicated_ids": sorted(set(dup_completions) | set(dup_exec))[:20],
            "in_run_log": sum(1 for i in done if logged[i] >= 1),
            "missing_from_run_log": sum(1 for i in done if logged[i] == 0),
            "missing_from_run_log_unexplained": sum(
                1 for i in done if logged[i] == 0 and not near_scheduler_kill(results[i])
            ),
            "attempts_histogram": {str(k): v for k, v in sorted(attempts.items())},
            # the same, in a fixed shape for the docs: 1, 2, 3 or more
            "attempts": {
                "1": attempts.get(1, 0),
                "2": attempts.get(2, 0),
                "3+": sum(v for a, v in attempts.items() if a >= 3),
            },
            "attempts_disagree_with_log": sum(
                1 for i in done if i in log_attempts and log_attempts[i] != int(results[i].get("attempts", 1))
            ),
            "act_s": percentiles([float(results[i].get("act_s", 0.0)) for i in done]),
            "sandbox_resets": sum(1 for i in done if results[i].get("sandbox_reset")),
        }
    table = []
    for k in kills:
        hit = hit_by(k)
        fates: Counter[str] = Counter()
        rows = []
        for a in hit:
            res = results.get(a.action_id)
            if res is None:
                fate = "lost"
            elif verify(expected[a.action_id], res) is not None:
                fate = "wrong"
            elif int(res.get("attempts", 1)) > max(1, a.attempt):
                fate = "retried"  # a new attempt ran it to its right result
            else:
                fate = "completed"  # same attempt (queued, or survived the kill), right result
            fates[fate] += 1
            rows.append(
                {
                    "action_id": a.action_id,
                    "kind": a.kind,
                    "state": a.state,
                    "attempt_before": a.attempt,
                    "attempts_final": int(res.get("attempts", 1)) if res else None,
                    "status": str(res.get("status")) if res else None,
                    "fate": fate,
                }
            )
        table.append(
            {
                "t_s": round(k.t_s, 1),
                "victim": k.victim,
                "in_flight": len(k.in_flight),
                "hit": len(hit),
                "hit_running": sum(1 for a in hit if a.state == "running"),
                "fates": dict(fates),
                "actions": rows,
            }
        )
    by_victim = {
        v: {
            "kills": sum(1 for row in table if row["victim"] == v),
            "hit": sum(row["hit"] for row in table if row["victim"] == v),
            "hit_running": sum(row["hit_running"] for row in table if row["victim"] == v),
            **{f: sum(row["fates"].get(f, 0) for row in table if row["victim"] == v) for f in FATES},
        }
        for v in VICTIMS
    }
    totals = {
        key: sum(kinds[k][key] for k in KINDS)
        for key in ("submitted", "completed", "lost", "wrong", "duplicated_completions")
    }
    totals["duplicated_executions"] = kinds["api"]["duplicated_executions"]
    totals["missing_from_run_log_unexplained"] = sum(
        kinds[k]["missing_from_run_log_unexplained"] for k in KINDS
    )
    totals["retried"] = sum(n for k in KINDS for a, n in kinds[k]["attempts_histogram"].items() if int(a) > 1)
    totals["kills"] = len(kills)
    totals["kills_that_hit_running_work"] = sum(1 for row in table if row["hit_running"] > 0)
    totals["hit_running_actions"] = sum(row["hit_running"] for row in table)
    totals["hit_running_lost_or_wrong"] = sum(
        1
        for row in table
        for a in row["actions"]
        if a["state"] == "running" and a["fate"] in ("lost", "wrong")
    )
    return {
        "totals": totals,
        "kinds": kinds,
        "by_victim": by_victim,
        "kills": table,
        "wrong_examples": wrong_examples[:20],
    }
