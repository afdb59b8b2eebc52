"""The demo workload: one step of agentic RL (rollout, then reward stage) on every pool.

Rollout: each trajectory solves one problem over several turns, like an agent would: it probes
its code (tool executions in a sandbox on a CPU node), calls an API (`calc` or `docsearch`),
submits a first (often buggy) attempt, runs an elastic test suite (`cpus='1..N'`), and computes
its final answer with its own code. Trajectories run concurrently; every turn waits for the
previous one's result, as a real rollout does.

Reward stage: every final answer is scored by every configured reward model at once, as a
trainer's reward stage does: a rule check (math-equiv: a CPU action), embedding similarity to a
reference sentence and a sequence-classification reward (GPU actions, which the scheduler sends
to a chunk together and the GPU worker scores in one Triton call).

At the end the summary gives ACT, the queue/exec split and batch sizes per pool, and `tangram
report` plots of this run are written to `<state_dir>/report/`.
"""

from __future__ import annotations

import json
import random
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from tangram_celery.client.sync import TangramClient
from tangram_celery.common.actions import ApiAction, CodeAction, RewardAction, TestCase
from tangram_celery.common.config import RewardModelConfig, TangramConfig
from tangram_celery.common.errors import TangramError
from tangram_celery.common.wire import ActionResult
from tangram_celery.demo_problems import PROBLEMS, Problem
from tangram_celery.demo_summary import Done, Summary
from tangram_celery.deploy.readiness import wait_warm, warm_nodes

Action = CodeAction | ApiAction | RewardAction


def reward_inputs(model: RewardModelConfig, problem: Problem, answer: str) -> dict[str, str]:
    """The inputs with which `model` scores a trajectory's final `answer` to `problem`."""
    if model.backend == "rule":
        return {"response": answer, "reference": problem.answer}
    if model.backend == "embedding-sim":
        return {"reference": problem.explanation, "response": answer}
    return {"prompt": problem.question, "response": answer}  # hf-seq-cls, teacher-logprobs


class _Trajectory:
    """One agent rollout: its turns, then the scoring of its final answer."""

    def __init__(
        self,
        client: TangramClient,
        cfg: TangramConfig,
        tid: str,
        problem: Problem,
        rng: random.Random,
        sink: Callable[[str, str, ActionResult], None],
        count: Callable[[int], None],
    ) -> None:
        self.client, self.cfg, self.tid, self.problem, self.rng = client, cfg, tid, problem, rng
        self.sink, self.count = sink, count

    def pool_of(self, action: Action) -> tuple[str, str]:
        """(pool kind, what) of an action, for the per-pool summary."""
        if isinstance(action, CodeAction):
            return "cpu", "tests" if action.test_cases else "code"
        if isinstance(action, ApiAction):
            return "api", action.api
        model = self.cfg.reward_model(action.model)
        return ("cpu" if model is not None and model.backend == "rule" else "gpu"), action.model

    def run_all(self, actions: list[Action]) -> list[ActionResult]:
        """Submit `actions` together and wait for every result."""
        self.count(len(actions))
        handles = self.client.submit_many(actions)
        out = []
        for action, handle in zip(actions, handles, strict=True):
            res = handle.result(timeout=600)
            self.sink(*self.pool_of(action), res)
            out.append(res)
        return out

    def run(self, turns: int, max_cpus: int, apis: list[str]) -> str:
        """The rollout: tool turns, the final test suite; returns the final answer (stdout)."""
        p, rng = self.problem, self.rng
        attempt = p.buggy if rng.random() < 0.5 else p.solution
        steps = max(1, turns - 1)
        answer = ""
        for turn in range(steps):
            if apis and turn == 1 and steps > 1:
                api = rng.choice(apis)
                req = (
                    {"expr": f"{rng.randint(1, 99)}*{rng.randint(1, 99)}"}
                    if api == "calc"
                    else {"query": p.name}
                )
                # 30 s: a loaded host can take longer than the 10 s default for docsearch's first
                # calls, which wait for its index (built once when the API worker starts)
                self.run_all([ApiAction(trajectory_id=self.tid, api=api, request=req, timeout_s=30)])
                continue
            last = turn == steps - 1
            code = attempt + "\n" + (p.answer_code if last else p.probe)  # the last turn prints the answer
            (res,) = self.run_all([CodeAction(trajectory_id=self.tid, code=code, timeout_s=30)])
            if last:
                answer = res.stdout.strip()[:2000]
            if turn == 0:
                attempt = p.solution if rng.random() < 0.8 else attempt  # the agent fixes its bug
        tests = [TestCase(name=n, assert_code=a) for n, a in p.tests]
        self.run_all(
            [
                CodeAction(
                    trajectory_id=self.tid,
                    code=attempt,
                    test_cases=tests,
                    cpus=f"1..{max_cpus}",
                    timeout_s=60,
                )
            ]
        )
        self.client.close_trajectory(self.tid)  # the rollout is over: its sandbox and memory go
        return answer

    def rewards(self, answer: str) -> list[RewardAction]:
        """The reward actions that score this trajectory's final `answer`: one per model."""
        return [
            RewardAction(trajectory_id=self.tid, model=m.name, inputs=reward_inputs(m, self.problem, answer))
            for m in self.cfg.reward_models
        ]


def _reward_stage(
    client: TangramClient,
    broker_url: str,
    cfg: TangramConfig,
    rewards: list[tuple[_Trajectory, RewardAction]],
    sink: Callable[[str, str, ActionResult], None],
    count: Callable[[int], None],
) -> None:
    """Score every final answer of the rollout at once, as a trainer's reward stage does: the
    scheduler sends the reward actions of one model on a GPU chunk together, and the GPU worker
    scores them in one Triton call. A fresh deployment warms its reward services in the
    background during the rollout; the stage waits for that rather than pay cold loads."""
    gpu = warm_nodes(cfg)
    if gpu:
        print("rollout done; the reward stage waits for the reward services to be warm ...", flush=True)
        t_warm = time.monotonic()
        warm = wait_warm(broker_url, gpu, timeout_s=600)
        waited_s = time.monotonic() - t_warm
        loaded = sum(len(st.loaded) for st in warm.values())
        print(f"reward services warm ({loaded} replica(s)); waited {waited_s:.1f} s for them", flush=True)
    models = sorted({r.model for _, r in rewards})
    print(
        f"reward stage: {len(rewards)} actions ({', '.join(models)}) for {len(rewards) // len(models)} final answers"
    )
    count(len(rewards))
    handles = client.submit_many([r for _, r in rewards])
    for (t, action), handle in zip(rewards, handles, strict=True):
        sink(*t.pool_of(action), handle.result(timeout=600))


def _write_report(cfg: TangramConfig, ids: set[str], out_dir: Path, wait_s: float = 10.0) -> Path:
    """`tangram report` plots of the actions `ids` (this run only) into `out_dir`.

    The scheduler appends completed actions to <state_dir>/actions.jsonl (flushed every second),
    which holds earlier runs too: this run's records are copied to out_dir/actions.jsonl first.
    """
    from tangram_celery.report import write_report

    log = Path(cfg.state_dir) / "actions.jsonl"
    deadline = time.monotonic() + wait_s
    while True:
        lines = log.read_text().splitlines() if log.exists() else []
        mine = [line for line in lines if line.strip() and json.loads(line).get("action_id") in ids]
        if len({json.loads(line)["action_id"] for line in mine}) >= len(ids) or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    if not mine:
        raise TangramError(f"no action of this run in {log}")
    out_dir.mkdir(parents=True, exist_ok=True)
    run_log = out_dir / "actions.jsonl"
    run_log.write_text("\n".join(mine) + "\n")
    write_report(cfg, out_dir, run_log, step_s=0.1)
    return out_dir


class _Tally:
    """The run's summary, filled from every trajectory's thread, and a progress line every 2 s."""

    def __init__(self) -> None:
        self.summary = Summary()
        self._lock = threading.Lock()
        self._done = threading.Event()

    def sink(self, pool: str, what: str, res: ActionResult) -> None:
        with self._lock:
            self.summary.done.append(Done(pool, what, res))

    def count(self, n: int) -> None:
        with self._lock:
            self.summary.submitted += n

    def start(self) -> None:
        threading.Thread(target=self._progress, daemon=True).start()

    def stop(self) -> None:
        self._done.set()

    def _progress(self) -> None:
        last = -1
        while not self._done.wait(2.0):
            with self._lock:
                n, sub = len(self.summary.done), self.summary.submitted
            if n != last or sub > n:  # quiet while nothing is in flight (the warm-up wait)
                print(f"  ... {n} actions done, {sub - n} in flight", flush=True)
            last = n


def _announce(cfg: TangramConfig, apis: list[str], trajectories: int, turns: int) -> None:
    """The demo's first line: the workload, the pools it runs on and the policy."""
    pools = [f"{len(cfg.nodes.cpu)} CPU node(s)"]
    if cfg.nodes.gpu and cfg.reward_models:
        pools.append(f"{len(cfg.nodes.gpu)} GPU node(s)")
    if apis:
        pools.append(f"APIs {', '.join(apis)}")
    models = (
        f"; final answers scored by {', '.join(m.name for m in cfg.reward_models)}"
        if cfg.reward_models
        else ""
    )
    print(
        f"demo: {trajectories} trajectories x {turns} turns on {', '.join(pools)}{models}; "
        f"policy {cfg.scheduler.policy}"
    )


def _rollout(
    client: TangramClient,
    cfg: TangramConfig,
    rng: random.Random,
    tally: _Tally,
    trajectories: int,
    turns: int,
    max_cpus: int,
    apis: list[str],
) -> list[tuple[_Trajectory, str]]:
    """Run every trajectory concurrently; (trajectory, final answer) of those that finished."""
    with ThreadPoolExecutor(max_workers=trajectories) as pool:
        trajs = [
            _Trajectory(
                client,
                cfg,
                f"demo-{i}",
                PROBLEMS[i % len(PROBLEMS)],
                random.Random(rng.random()),
                tally.sink,
                tally.count,
            )
            for i in range(trajectories)
        ]
        futs = [pool.submit(t.run, turns, max_cpus, apis) for t in trajs]
        answers: list[tuple[_Trajectory, str]] = []
        for t, f in zip(trajs, futs, strict=True):
            try:
                answers.append((t, f.result()))
            except TangramError as e:
                print(f"  trajectory failed: {e}")
    return answers


def run_demo(
    broker_url: str,
    cfg: TangramConfig,
    *,
    trajectories: int = 24,
    turns: int = 4,
    seed: int = 0,
    report: bool = True,
) -> Summary:
    """Run the workload and print progress and a summary. Returns the summary."""
    if not cfg.nodes.cpu:
        raise TangramError("the demo needs at least one CPU node in nodes.cpu")
    rng = random.Random(seed)
    apis = [a.name for a in cfg.apis if a.name in ("calc", "docsearch")]
    max_cpus = max(len(g) for n in cfg.nodes.cpu for g in n.numa_split())  # the largest NUMA group
    tally = _Tally()
    _announce(cfg, apis, trajectories, turns)
    tally.start()
    t0 = time.monotonic()
    with TangramClient(broker_url, config=cfg) as client:
        answers = _rollout(client, cfg, rng, tally, trajectories, turns, max_cpus, apis)
        rewards = [(t, r) for t, answer in answers if answer for r in t.rewards(answer)]
        if rewards:
            _reward_stage(client, broker_url, cfg, rewards, tally.sink, tally.count)
    tally.stop()
    summary = tally.summary
    summary.wall_s = time.monotonic() - t0
    if report:
        try:
            summary.report_dir = _write_report(
                cfg, {r.action_id for r in summary.results}, Path(cfg.state_dir) / "report"
            )
        except (TangramError, OSError, ValueError) as e:
            summary.report_error = str(e)
    print(summary.report())
    return summary
