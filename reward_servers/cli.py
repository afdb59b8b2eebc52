"""`tangram reward deploy|status|undeploy [CONFIG]`: run reward servers from the YAML config.

`deploy` writes each GPU node's Triton repository under `<state_dir>/reward/<node>/`, starts a
tritonserver there in the background (explicit model-control mode, 127.0.0.1, free ports) and
records its pid and ports in `server.json`; GPU workers attach to it with
`RewardService(cfg, node, attach=True)`. `undeploy` stops exactly the recorded pids.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from reward_servers.naming import replica_name
from reward_servers.repository import build_repository, instance_kind
from reward_servers.service import node_dir
from reward_servers.tiny_models import build_missing
from reward_servers.triton import ServerInfo, TritonController, TritonServer, http_ok, pid_alive, stop_pid
from tangram_celery.common.config import GpuNodeConfig, TangramConfig, default_config_path, load_config
from tangram_celery.common.errors import TangramError


def _nodes(cfg: TangramConfig, names: list[str] | None) -> list[GpuNodeConfig]:
    nodes = [n for n in cfg.nodes.gpu if not names or n.name in names]
    unknown = set(names or ()) - {n.name for n in nodes}
    if unknown:
        raise TangramError(
            f"unknown GPU node(s) {sorted(unknown)}; declared: {[n.name for n in cfg.nodes.gpu]}"
        )
    if not nodes:
        raise TangramError("the config declares no GPU node (nodes.gpu): nothing to deploy")
    return nodes


def _running(cfg: TangramConfig, node: str) -> ServerInfo | None:
    path = node_dir(cfg, node) / "server.json"
    if not path.exists():
        return None
    info = ServerInfo.load(path)
    return info if pid_alive(info.pid) else None


def deploy(
    cfg: TangramConfig, nodes: list[str] | None = None, preload: bool = False
) -> dict[str, ServerInfo]:
    """Start one tritonserver per GPU node (kept if already running); optionally load each model's
    smallest-DoP replica on the first chunk. Returns node -> server info."""
    out = {}
    targets = _nodes(cfg, nodes)
    build_missing(cfg)  # models declared with `build:` are made once, before Triton looks for them
    for node in targets:
        info = _running(cfg, node.name)
        if info is None:
            work = node_dir(cfg, node.name)
            work.mkdir(parents=True, exist_ok=True)
            build_repository(cfg.reward_models, node, work / "repo")
            info = TritonServer(work / "repo", work).start(detach=True)
            info.save(work / "server.json")
        if preload:
            ctl = TritonController.of(info)
            for m in cfg.reward_models:
                if m.backend != "rule":
                    dop = min(m.dop_options)
                    ctl.load(replica_name(m.name, dop, tuple(range(dop))))
        out[node.name] = info
    return out


def status(cfg: TangramConfig, nodes: list[str] | None = None) -> dict[str, dict[str, Any]]:
    """Per GPU node: whether a server is deployed, its pid/url, liveness and each loaded model's state."""
    out: dict[str, dict[str, Any]] = {}
    for node in _nodes(cfg, nodes):
        path = node_dir(cfg, node.name) / "server.json"
        entry: dict[str, Any] = {"deployed": path.exists(), "instance_kind": instance_kind(node)}
        if path.exists():
            info = ServerInfo.load(path)
            alive = pid_alive(info.pid) and http_ok(info.url)
            entry.update(pid=info.pid, url=info.url, alive=alive, log=info.log_path)
            if alive:
                entry["models"] = TritonController.of(info).loaded()
        out[node.name] = entry
    return out


def undeploy(cfg: TangramConfig, nodes: list[str] | None = None) -> list[str]:
    """Stop the recorded tritonserver of each node (by pid) and forget it; returns the nodes stopped."""
    stopped = []
    for node in _nodes(cfg, nodes):
        path = node_dir(cfg, node.name) / "server.json"
        if path.exists():
            stop_pid(ServerInfo.load(path).pid)
            path.unlink()
            stopped.append(node.name)
    return stopped


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="tangram reward", description="Reward servers on Triton.")
    sub = ap.add_subparsers(dest="cmd", required=True)
    for name, text in (
        ("deploy", "generate the model repository and start tritonserver per GPU node"),
        ("status", "show each node's server and loaded models"),
        ("undeploy", "stop the servers started by deploy"),
    ):
        p = sub.add_parser(name, help=text)
        p.add_argument("config", nargs="?", help="YAML config (default: configs/local.yaml)")
        p.add_argument("--node", action="append", help="only this GPU node (repeatable)")
        if name == "deploy":
            p.add_argument("--preload", action="store_true", help="load each model's smallest DoP now")
        if name == "status":
            p.add_argument("--json", action="store_true", help="machine-readable output")
    args = ap.parse_args(argv)
    try:
        cfg = load_config(args.config or default_config_path())
        if args.cmd == "deploy":
            for node, info in deploy(cfg, args.node, args.preload).items():
                print(f"{node}: tritonserver pid {info.pid} at http://{info.url} (log {info.log_path})")
        elif args.cmd == "status":
            st = status(cfg, args.node)
            if args.json:
                print(json.dumps(st, indent=2))
            for node, e in st.items() if not args.json else ():
                if not e["deployed"]:
                    print(f"{node}: not deployed")
                    continue
                print(f"{node}: pid {e['pid']} {'alive' if e['alive'] else 'DOWN'} at http://{e['url']}")
                for model, state in sorted(e.get("models", {}).items()):
                    print(f"  {model}: {state}")
            return 0 if all(e.get("alive", True) for e in st.values()) else 1
        else:
            stopped = undeploy(cfg, args.node)
            print(f"stopped: {', '.join(stopped) or 'nothing was deployed'}")
    except TangramError as e:
        print(f"tangram reward {args.cmd}: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
