"""`tangram` command line: config check, up, demo, submit, scheduler, worker, nodes, flower, sim,
reward, tenant."""

from __future__ import annotations

import argparse
import json
import logging
import signal
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

from tangram_celery.common.config import TangramConfig, default_config_path, load_config
from tangram_celery.common.errors import TangramError

if TYPE_CHECKING:
    from tangram_celery.deploy.stack import Deployment


def _config(args: argparse.Namespace) -> TangramConfig:
    return load_config(args.config or default_config_path())


def _add_config(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", "-c", help="deployment YAML (default: configs/local.yaml)")


def _add_metrics(p: argparse.ArgumentParser) -> None:
    p.add_argument("--metrics-port", type=int, default=0, help="Prometheus endpoint port (0 = off)")
    p.add_argument(
        "--metrics-addr", default="127.0.0.1", help="address of the endpoint (default loopback only)"
    )


def cmd_config_check(args: argparse.Namespace) -> int:
    cfg = load_config(args.file)
    print(json.dumps(cfg.model_dump(mode="json"), indent=2))
    print(f"{args.file}: OK", file=sys.stderr)
    return 0


def cmd_scheduler(args: argparse.Namespace) -> int:
    from scheduler.service import SchedulerService
    from tangram_celery.common.metrics import serve
    from tangram_celery.transport.broker import resolve_url

    cfg = _config(args)
    svc = SchedulerService(cfg, resolve_url(cfg))
    serve(svc.metrics.registry, args.metrics_port, args.metrics_addr)
    signal.signal(signal.SIGTERM, lambda *_: svc.stop())
    try:
        svc.run()
    except KeyboardInterrupt:
        svc.stop()
    return 0


def cmd_worker(args: argparse.Namespace) -> int:
    from tangram_celery.workers.capacity import Caps, parse_cpulist
    from tangram_celery.workers.process import run_worker

    caps = Caps(
        cpuset=tuple(parse_cpulist(args.cpuset)) if args.cpuset else None,
        cores=args.cores,
        memory_mb=args.memory_mb,
        gpus=args.gpus,
        gpu_memory_mb=args.gpu_memory_mb,
    )
    run_worker(
        _config(args),
        args.kind,
        (args.name or args.node) if args.kind == "api" else args.node,
        concurrency=args.concurrency,
        metrics_port=args.metrics_port,
        metrics_addr=args.metrics_addr,
        task_events=args.task_events == "on",
        caps=caps,
    )
    return 0


def _deployment(args: argparse.Namespace, with_flower: bool = True) -> Deployment:
    from tangram_celery.deploy.stack import Deployment

    path = Path(args.config or default_config_path())
    return Deployment(load_config(path), path, with_flower=with_flower)


STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


class StopRequested(BaseException):
    """SIGINT, SIGTERM or SIGHUP arrived: stop everything (a BaseException, like Ctrl-C)."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


def _stop_on_signals() -> None:
    """Turn the first SIGINT/SIGTERM/SIGHUP (Ctrl-C, `docker stop`, systemd, a closed terminal)
    into StopRequested in the main thread; later ones are ignored so that stopping completes."""

    def handler(signum: int, frame: object) -> None:
        for s in STOP_SIGNALS:
            signal.signal(s, signal.SIG_IGN)
        raise StopRequested(signum)

    for s in STOP_SIGNALS:
        signal.signal(s, handler)


def _say(text: str) -> None:
    try:  # after SIGHUP the terminal may be gone
        print(text, flush=True)
    except OSError:
        pass


def _preflight(dep: Deployment) -> None:
    """Before anything starts: can the CPU workers' sandbox run here? Else say why and stop."""
    if not dep.cfg.nodes.cpu:
        return
    from tangram_celery.sandbox.preflight import check_sandbox

    _say("checking the sandbox ...")
    problem = check_sandbox(dep.cfg.sandbox)
    if problem is not None:
        raise TangramError(
            f"the CPU workers' sandbox cannot run on this machine, so nothing was started:\n  {problem}"
        )


def cmd_up(args: argparse.Namespace) -> int:
    dep = _deployment(args, with_flower=not args.no_flower)
    _stop_on_signals()
    try:
        _preflight(dep)
        dep.start()
        if dep.flower_url:
            _say(f"flower: {dep.flower_url} (user {dep.flower_auth[0]}, password {dep.flower_auth[1]})")
        if dep.http_url:
            _say(
                f"http: {dep.http_url} (SandboxFusion URL {dep.http_url}/run_code, docs {dep.http_url}/docs)"
            )
            from tangram_celery.deploy.http_child import http_access_note

            _say(http_access_note(dep.cfg, dep.state_dir))
        _say(f"logs: {dep.state_dir / 'logs'}; Ctrl-C (or SIGTERM, SIGHUP) stops everything")
        while True:  # the deployment's supervisor restarts children that exit
            time.sleep(1.0)
    except StopRequested as e:
        _say(f"\n{e}: stopping ...")
    finally:
        for s in STOP_SIGNALS:
            signal.signal(s, signal.SIG_IGN)
        dep.stop()
    return 0


def cmd_serve(args: argparse.Namespace) -> int:
    from prometheus_client import CollectorRegistry

    from tangram_celery.common.metrics import serve as serve_metrics
    from tangram_celery.transport.broker import resolve_url
    from tangram_celery.web.serve import serve

    cfg = _config(args)
    registry = CollectorRegistry()
    serve_metrics(registry, args.metrics_port, args.metrics_addr)
    # uvicorn handles SIGINT / SIGTERM itself: it stops accepting, finishes requests, exits
    try:
        serve(
            cfg,
            resolve_url(cfg),
            port=args.port,
            prefer_port=args.prefer_port,
            address=args.address,
            registry=registry,
        )
    except KeyboardInterrupt:  # uvicorn re-raises the Ctrl-C it shut down on
        pass
    return 0


def cmd_demo(args: argparse.Namespace) -> int:
    from tangram_celery.demo import run_demo

    if args.workload == "swe":  # the task images first (built once, cached), and the demo's config
        from tangram_celery.swe.demo import prepare, run_swe_demo

        args.config = str(prepare(Path(args.config or default_config_path())))
    dep = _deployment(args, with_flower=not args.no_flower)
    _stop_on_signals()
    try:
        _preflight(dep)
        dep.start()
        if dep.flower_url:
            _say(f"flower: {dep.flower_url} (user {dep.flower_auth[0]}, password {dep.flower_auth[1]})")
        if args.workload == "swe":
            ok = run_swe_demo(dep.url, dep.cfg, trajectories=args.trajectories).ok
        else:
            ok = run_demo(dep.url, dep.cfg, trajectories=args.trajectories, turns=args.turns).lost == 0
    except StopRequested as e:
        _say(f"\n{e}: stopping ...")
        return 128 + e.signum
    finally:
        for s in STOP_SIGNALS:
            signal.signal(s, signal.SIG_IGN)
        dep.stop()
    return 0 if ok else 1


def cmd_submit(args: argparse.Namespace) -> int:
    from tangram_celery.client.sync import TangramClient

    action = json.loads(Path(args.action).read_text() if args.action != "-" else sys.stdin.read())
    with TangramClient.from_config(args.config or default_config_path()) as client:
        res = client.submit(action).result(timeout=args.timeout)
    print(res.model_dump_json(indent=2))
    return 0 if res.ok else 3


def cmd_flower(args: argparse.Namespace) -> int:
    import os
    import secrets

    from tangram_celery.deploy.flower import flower_command, pool_queues
    from tangram_celery.transport.broker import resolve_url

    cfg = _config(args)
    password = cfg.flower.password or secrets.token_urlsafe(12)
    password = os.environ.get("TANGRAM_FLOWER_PASSWORD") or password
    where = f"http://{cfg.flower.address}:{cfg.flower.port}"
    shown = "from TANGRAM_FLOWER_PASSWORD" if os.environ.get("TANGRAM_FLOWER_PASSWORD") else password
    print(f"flower on {where} (user {cfg.flower.user}, password {shown})")
    cmd, extra = flower_command(
        resolve_url(cfg), cfg.flower.port, cfg.flower.address, (cfg.flower.user, password), pool_queues(cfg)
    )
    os.execve(sys.executable, cmd, dict(os.environ, **extra))


def cmd_nodes(args: argparse.Namespace) -> int:
    from tangram_celery.nodes import show
    from tangram_celery.store import Store
    from tangram_celery.transport.broker import resolve_url

    store = Store(resolve_url(_config(args)), retry_budget_s=5.0)
    print(show(store, args.json))
    return 0


def cmd_report(args: argparse.Namespace) -> int:
    from tangram_celery.report import write_report

    cfg = _config(args)
    files = write_report(cfg, Path(args.out), Path(args.log) if args.log else None, step_s=args.step_s)
    for f in files:
        print(f"wrote {f}")
    return 0


def cmd_sim(rest: list[str]) -> int:
    from scheduler.sim.cli import main as sim_main

    return sim_main(rest)


def cmd_swe(rest: list[str]) -> int:
    from tangram_celery.swe.cli import main as swe_main

    return swe_main(rest)


def cmd_reward(rest: list[str]) -> int:
    from reward_servers.cli import main as reward_main

    return reward_main(rest)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="tangram", description=__doc__)
    p.add_argument("-v", "--verbose", action="store_true")
    sub = p.add_subparsers(dest="cmd", required=True)
    _add_stack_commands(sub)
    _add_process_commands(sub)
    _add_tool_commands(sub)
    from tangram_celery.tenant_cli import add_tenant_commands

    add_tenant_commands(sub)
    return p


def _add_stack_commands(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """config check, up, demo and serve."""
    c = sub.add_parser("config", help="validate configs")
    csub = c.add_subparsers(dest="config_cmd", required=True)
    chk = csub.add_parser("check", help="validate FILE and print the resolved config")
    chk.add_argument("file")
    chk.set_defaults(fn=cmd_config_check)

    for name, fn, helptext in (
        ("up", cmd_up, "start Redis, scheduler, workers and Flower; Ctrl-C, SIGTERM or SIGHUP stops them"),
        ("demo", cmd_demo, "start everything and run a sample agentic workload"),
    ):
        sp = sub.add_parser(name, help=helptext)
        _add_config(sp)
        sp.add_argument("--no-flower", action="store_true", help="do not start Flower")
        if name == "demo":
            sp.add_argument("--trajectories", type=int, default=24, help="number of trajectories")
            sp.add_argument("--turns", type=int, default=4, help="code turns per trajectory")
            sp.add_argument(
                "--workload",
                choices=["agentic", "swe"],
                default="agentic",
                help="swe: coding tasks in images",
            )
        sp.set_defaults(fn=fn)

    sv = sub.add_parser("serve", help="HTTP server: SandboxFusion-compatible /run_code and native endpoints")
    _add_config(sv)
    _add_metrics(sv)
    sv.add_argument("--port", type=int, default=None, help="override http.port (0 = a free port)")
    sv.add_argument(
        "--prefer-port", type=int, default=0, help="with http.port 0: try this port first (taken: a free one)"
    )
    sv.add_argument("--address", default=None, help="override http.address")
    sv.set_defaults(fn=cmd_serve)


def _add_process_commands(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """The processes a deployment runs: scheduler and worker."""
    s = sub.add_parser("scheduler", help="run the central scheduler")
    _add_config(s)
    _add_metrics(s)
    s.set_defaults(fn=cmd_scheduler)

    w = sub.add_parser("worker", help="run a worker for one pool")
    w.add_argument("kind", choices=["cpu", "api", "gpu"])
    w.add_argument(
        "--node",
        help="CPU/GPU node name (default: $TANGRAM_NODE, else the host name); a name the config "
        "does not declare joins with the capacity detected here",
    )
    w.add_argument("--cpuset", help="host cores the node may lend, e.g. 0-7,16 (narrows detection)")
    w.add_argument("--cores", type=int, help="lend at most this many cores")
    w.add_argument("--memory-mb", type=int, help="memory the node lends to sandboxes, MiB")
    w.add_argument("--gpus", type=int, help="GPUs of a GPU node (1, 2, 4 or 8)")
    w.add_argument("--gpu-memory-mb", type=int, help="memory per GPU of a GPU node, MiB")
    w.add_argument("--name", help="API name")
    w.add_argument("--concurrency", type=int, default=None, help="slots (default: from the pool)")
    w.add_argument(
        "--task-events",
        choices=["on", "off"],
        default="on",
        help="send Celery task events from the start (Flower's task list); off: only once a "
        "monitor enables them (Flower does every few seconds)",
    )
    _add_metrics(w)
    _add_config(w)
    w.set_defaults(fn=cmd_worker)


def _add_tool_commands(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """submit, report, flower, and sim and reward (which parse their own arguments)."""
    sm = sub.add_parser("submit", help="submit one action (JSON file or - for stdin) and print its result")
    sm.add_argument("action")
    sm.add_argument("--timeout", type=float, default=120.0)
    _add_config(sm)
    sm.set_defaults(fn=cmd_submit)

    nd = sub.add_parser("nodes", help="list the CPU/GPU nodes: kind, state, capacity and load")
    nd.add_argument("--json", action="store_true", help="JSON instead of a table")
    _add_config(nd)
    nd.set_defaults(fn=cmd_nodes)

    rp = sub.add_parser("report", help="PNG plots of ACT over time and utilisation per pool from a run")
    _add_config(rp)
    rp.add_argument("--log", help="action log (default: <state_dir>/actions.jsonl)")
    rp.add_argument("--out", default="report", help="output directory")
    rp.add_argument(
        "--step-s", type=float, default=None, help="utilisation sampling step, s (default: span/400)"
    )
    rp.set_defaults(fn=cmd_report)

    f = sub.add_parser("flower", help="run Flower with basic auth")
    _add_config(f)
    f.set_defaults(fn=cmd_flower)

    sub.add_parser("sim", help="trace-driven simulator (see `tangram sim --help`)", add_help=False)
    sub.add_parser("reward", help="reward servers on Triton (see `tangram reward --help`)", add_help=False)
    sub.add_parser("swe", help="SWE task images: build, list (see `tangram swe --help`)", add_help=False)


def main(argv: list[str] | None = None) -> int:
    from tangram_celery.common.lifeline import arm_from_env

    arm_from_env()  # a child of `tangram up` dies with it (and exits if it is already gone)
    argv = list(sys.argv[1:] if argv is None else argv)
    # sim and reward own their argument parsing.
    for name, fn in (("sim", cmd_sim), ("reward", cmd_reward), ("swe", cmd_swe)):
        if argv[:1] == [name]:
            return fn(argv[1:])
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    try:
        return int(args.fn(args) or 0)
    except TangramError as e:
        print(f"tangram: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
