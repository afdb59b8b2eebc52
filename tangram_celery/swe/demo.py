"""`tangram demo --workload swe`: scripted SWE-style trajectories in their task images.

`prepare` builds (or finds cached) the task images: the OCI layout that the namespace backend's
image store reads, and the images in the Docker engine when the deployment's sandbox may use
one. It writes a copy of the config for the demo: the SWE layout among `sandbox.images.oci_dirs`,
and no GPU pool or reward models (the reward here is the harness's test verdict).

`run_swe_demo` then runs trajectories concurrently through `TangramClient`, each the five steps of
agent.py in its task's image, of these kinds, spread over the tasks: most fix the bug; per task
one submits without a change and the others cheat (edit the tests, plant a conftest.py). The
summary gives per task the pass rate and whether every reward was the one the trajectory's kind
deserves, then ACT and the queue/exec split, overall and per step.
"""

from __future__ import annotations

import os
import statistics
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from tangram_celery.client.sync import TangramClient
from tangram_celery.common.config import TangramConfig, load_config
from tangram_celery.common.errors import TangramError
from tangram_celery.sandbox.backends import docker_reachable
from tangram_celery.swe.agent import CHEATS, Outcome, run_trajectory
from tangram_celery.swe.build import build, hidden_files
from tangram_celery.swe.tasks import TASKS, SweTask

STEPS = ("inspect", "reproduce", "edit", "verify", "reward")
DEFAULT_DOCKER = "unix:///var/run/docker.sock"


def engine_for(cfg: TangramConfig) -> str | None:
    """The Docker engine the deployment's sandboxes may use (None: the namespace backend only)."""
    if cfg.sandbox.backend == "namespace":
        return None
    url = cfg.sandbox.docker_host or os.environ.get("DOCKER_HOST") or DEFAULT_DOCKER
    return url if docker_reachable(url) else None


def demo_config(path: Path, layout: Path, out: Path) -> Path:
    """A copy of the config at `path` for the SWE demo, written to `out`: the layout `layout`
    among the image store's sources, no GPU pool and no reward models."""
    data: dict[str, Any] = yaml.safe_load(path.read_text()) or {}
    data["nodes"] = {k: v for k, v in (data.get("nodes") or {}).items() if k != "gpu"}
    data.pop("reward_models", None)
    sandbox = dict(data.get("sandbox") or {})
    images = dict(sandbox.get("images") or {})
    images["oci_dirs"] = [*(d for d in images.get("oci_dirs") or [] if d != str(layout)), str(layout)]
    data["sandbox"] = {**sandbox, "images": images}
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(yaml.safe_dump(data, sort_keys=False))
    return out


def prepare(config_path: Path, log: Callable[[str], None] = print) -> Path:
    """Build or reuse the task images for the deployment of `config_path`; the demo's config."""
    cfg = load_config(config_path)
    engine = engine_for(cfg)
    t0 = time.monotonic()
    built = build(TASKS, docker_host=engine, log=log)
    where = f"OCI layout {built.layout}" + (f" and Docker engine {engine}" if engine else "")
    log(f"swe: {len(TASKS)} task images ready in {time.monotonic() - t0:.1f} s ({where})")
    assert built.layout is not None
    return demo_config(config_path, built.layout, Path(cfg.state_dir) / "swe-demo.yaml")


def plan(trajectories: int, tasks: tuple[SweTask, ...] = TASKS) -> list[tuple[SweTask, str]]:
    """(task, kind) of each trajectory: tasks in turn; of a task's trajectories the 2nd submits
    without a change, the 3rd cheats (a different way per task), the rest fix the bug."""
    out = []
    for i in range(trajectories):
        t, j = tasks[i % len(tasks)], i // len(tasks)
        kind = {1: "no-fix", 2: CHEATS[(i % len(tasks)) % len(CHEATS)]}.get(j, "fix")
        out.append((t, kind))
    return out


@dataclass
class SweSummary:
    outcomes: list[Outcome] = field(default_factory=list)
    failed: list[str] = field(default_factory=list)  # trajectories that raised
    wall_s: float = 0.0

    @property
    def ok(self) -> bool:
        """Every trajectory finished, each with the reward its kind deserves."""
        return bool(self.outcomes) and not self.failed and not self.unexpected

    @property
    def unexpected(self) -> list[Outcome]:
        """Trajectories whose reward is not the one their kind deserves (a fix 1, the rest 0)."""
        return [o for o in self.outcomes if o.reward != o.expected_reward]

    def task_line(self, name: str) -> str:
        mine = [o for o in self.outcomes if o.task == name]
        kinds: dict[str, list[float]] = {}
        for o in mine:
            kinds.setdefault(o.kind, []).append(o.reward)
        reproduced = sum(o.results["reproduce"].exit_code not in (0, None) for o in mine)
        by_kind = ", ".join(f"{k} {sum(v):.0f}/{len(v)}" for k, v in kinds.items())
        rate = sum(o.reward for o in mine) / max(1, len(mine))
        return f"{name}: pass rate {rate:.0%} of {len(mine)} ({by_kind}); bug reproduced in {reproduced}/{len(mine)}"

    def report(self) -> str:
        rs = [r for o in self.outcomes for r in o.results.values()]
        if not rs:
            return "no trajectory completed" + (f" ({len(self.failed)} failed)" if self.failed else "")
        lines = [f"{len(self.outcomes)} trajectories, {len(rs)} actions in {self.wall_s:.1f} s"]
        lines += [
            f"  {self.task_line(t.name)}" for t in TASKS if any(o.task == t.name for o in self.outcomes)
        ]
        bad = self.unexpected
        lines.append(
            "rewards: every one as deserved (fixes 1; no change, edited tests, planted conftest.py 0)"
            if not bad
            else "rewards NOT as deserved: "
            + ", ".join(f"{o.tid} ({o.kind}) got {o.reward:.0f}" for o in bad)
        )
        lines.append("all actions: " + _act_line(rs))
        for step in STEPS:
            lines.append(
                f"  {step:9s} " + _act_line([o.results[step] for o in self.outcomes if step in o.results])
            )
        lines += [f"failed: {f}" for f in self.failed]
        return "\n".join(lines)


def _ms(s: float) -> str:
    return f"{s * 1000:.0f} ms"


def _act_line(rs: list[Any]) -> str:
    """ACT mean / p50 / p99 and the mean queue + exec split of results `rs`."""
    if not rs:
        return "none"
    acts = sorted(r.act_s for r in rs)
    q, e = statistics.fmean(r.queue_s for r in rs), statistics.fmean(r.exec_s for r in rs)
    p = lambda f: acts[min(len(acts) - 1, int(f * len(acts)))]  # noqa: E731
    return (
        f"{len(rs)} actions; ACT mean {_ms(statistics.fmean(acts))}, p50 {_ms(p(0.5))}, p99 {_ms(p(0.99))}; "
        f"queue {_ms(q)} + exec {_ms(e)} ({100 * q / max(q + e, 1e-9):.0f}% queueing)"
    )


def run_swe_demo(
    broker_url: str, cfg: TangramConfig, *, trajectories: int = 12, concurrency: int = 0
) -> SweSummary:
    """Run `trajectories` scripted trajectories (all at once unless `concurrency` > 0) and print
    progress and the summary."""
    if not cfg.nodes.cpu:
        raise TangramError("the SWE demo needs at least one CPU node in nodes.cpu")
    hidden = {t.name: hidden_files(t) for t in TASKS}
    jobs = plan(trajectories)
    print(
        f"swe demo: {len(jobs)} trajectories over {len(TASKS)} tasks ({', '.join(t.image for t in TASKS)}); "
        f"policy {cfg.scheduler.policy}",
        flush=True,
    )
    summary, lock = SweSummary(), threading.Lock()
    t0 = time.monotonic()
    with TangramClient(broker_url, config=cfg) as client:

        def one(i: int, t: SweTask, kind: str) -> None:
            tid = f"swe-{t.name}-{i}"
            try:
                out = run_trajectory(
                    lambda a: client.submit(a).result(timeout=600), t, tid, hidden[t.name], kind
                )
            except TangramError as e:
                with lock:
                    summary.failed.append(f"{tid}: {e}")
                return
            finally:
                client.close_trajectory(tid)
            with lock:
                summary.outcomes.append(out)
                print(
                    f"  {tid} ({kind}): reward {out.reward:.0f} [{len(summary.outcomes)}/{len(jobs)}]",
                    flush=True,
                )

        with ThreadPoolExecutor(max_workers=concurrency or len(jobs)) as pool:
            for f in [pool.submit(one, i, t, k) for i, (t, k) in enumerate(jobs)]:
                f.result()
    summary.wall_s = time.monotonic() - t0
    print(summary.report())
    return summary
