"""`tangram sim` (also `python -m scheduler.sim`): run scenarios under policies, record traces.

tangram sim run --scenario coding --policy tangram-fast --policy static-pod [--set batch=256]
tangram sim run --scenario coding --policy static-pod:packing=binpack,max_pods=110
tangram sim run --config configs/sim/coding.yaml --out results.jsonl
tangram sim record --scenario mopd --out mopd.trace.jsonl
tangram sim replay --trace mopd.trace.jsonl --policy tangram-fast
tangram sim policies
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path
from typing import Any

from scheduler.policies import available
from scheduler.policies.base import Policy
from scheduler.sim.cluster import ClusterSpec
from scheduler.sim.runner import make_policy, simulate
from scheduler.sim.scenarios import GENERATORS, Scenario, build
from scheduler.sim.trace import load_workload, save_workload, write_results


def _parse_pairs(items: list[str], what: str) -> dict[str, Any]:
    """`key=value` items as a dict; values are JSON, else strings."""
    out: dict[str, Any] = {}
    for item in items:
        key, sep, raw = item.partition("=")
        if not sep or not key:
            raise ValueError(f"{what} wants key=value, got {item!r}")
        try:
            out[key] = json.loads(raw)
        except json.JSONDecodeError:
            out[key] = raw
    return out


def _parse_sets(items: list[str], option: str) -> dict[str, Any]:
    try:
        return _parse_pairs(items, option)
    except ValueError as e:
        raise SystemExit(str(e)) from None


def _load_config(path: str | None) -> dict[str, Any]:
    if not path:
        return {}
    import yaml

    with open(path) as f:
        data = yaml.safe_load(f) or {}
    if not isinstance(data, dict):
        raise SystemExit(f"{path}: expected a mapping at top level")
    return data


def _scenario(args: argparse.Namespace) -> tuple[Scenario, list[Any]]:
    cfg = _load_config(getattr(args, "config", None))
    name = args.scenario or cfg.get("scenario")
    if name not in GENERATORS:
        raise SystemExit(f"choose a scenario with --scenario: {', '.join(GENERATORS)}")
    params = {**cfg.get("params", {}), **_parse_sets(args.set or [], "--set")}
    policies = list(getattr(args, "policy", None) or cfg.get("policies", []))
    cluster_over = {
        **cfg.get("cluster", {}),
        **_parse_sets(getattr(args, "cluster", None) or [], "--cluster"),
    }
    try:
        scenario = build(name, params)
        if cluster_over:
            known = {f.name for f in dataclasses.fields(ClusterSpec)} - {"apis"}
            bad = sorted(set(cluster_over) - known)
            if bad:
                raise ValueError(f"unknown cluster keys {bad}; known: {sorted(known)}")
            cluster = dataclasses.replace(scenario.cluster, **cluster_over)
            scenario = dataclasses.replace(scenario, cluster=cluster)
        return scenario, policies
    except (TypeError, ValueError) as e:
        raise SystemExit(f"tangram sim: {e}") from None


def policy_spec(spec: str | dict[str, Any]) -> tuple[str, dict[str, Any]]:
    """A policy and its parameters from `name` or `name:key=value,key=value` (values are JSON,
    else strings), or from a config mapping `{name: ..., key: value}`."""
    if isinstance(spec, dict):
        params = dict(spec)
        name = params.pop("name", None)
        if not isinstance(name, str):
            raise ValueError(f"a policy mapping needs a 'name', got {spec!r}")
        return name, params
    name, _, rest = str(spec).partition(":")
    return name, _parse_pairs(list(filter(None, rest.split(","))), f"policy {spec!r}")


def policy_label(name: str, params: dict[str, Any]) -> str:
    """How results name a policy: `name`, or `name:key=value,...` with its parameters."""
    text = {k: v if isinstance(v, str) else json.dumps(v) for k, v in params.items()}
    return name + (":" + ",".join(f"{k}={v}" for k, v in text.items()) if params else "")


def _policies(scenario: Scenario, specs: list[Any]) -> list[tuple[str, Policy]]:
    """(label, policy) per spec; any bad name or parameter stops before anything runs."""
    out = []
    for spec in specs:
        try:
            name, params = policy_spec(spec)
            out.append((policy_label(name, params), make_policy(name, scenario, **params)))
        except TypeError as e:
            raise SystemExit(f"tangram sim: policy {spec!r}: {e}") from None
        except (KeyError, ValueError) as e:
            raise SystemExit(f"tangram sim: {e.args[0] if e.args else e}") from None
    return out


def _run(scenario: Scenario, policies: list[Any], out: str | None) -> int:
    if not policies:
        raise SystemExit("give at least one --policy; see `tangram sim policies`")
    built = _policies(scenario, policies)
    sink = open(out, "w") if out else None  # noqa: SIM115
    try:
        for label, policy in built:
            result = simulate(scenario, policy)
            result.policy = label  # with its parameters, when given
            summary = result.summary()
            print(json.dumps(summary, default=float))
            if sink is not None:
                write_results(result, sink)
    finally:
        if sink is not None:
            sink.close()
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="tangram sim", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    sub = parser.add_subparsers(dest="cmd", required=True)
    run = sub.add_parser("run", help="simulate a generated scenario")
    rec = sub.add_parser("record", help="write a generated scenario as a JSONL workload trace")
    for p in (run, rec):
        p.add_argument("--scenario", choices=sorted(GENERATORS))
        p.add_argument("--config", help="YAML with scenario, params, policies (configs/sim/)")
        p.add_argument(
            "--set", action="append", metavar="KEY=VALUE", help="override a scenario parameter (JSON value)"
        )
        p.add_argument(
            "--cluster",
            action="append",
            metavar="KEY=VALUE",
            help="override a cluster field, e.g. cpu_nodes=5 (see scheduler/sim/cluster.py ClusterSpec)",
        )
    run.add_argument(
        "--policy",
        action="append",
        help="policy name, or name:key=value,... with its parameters (repeatable)",
    )
    run.add_argument("--out", help="write per-action results as JSONL")
    rec.add_argument("--out", required=True)
    rep = sub.add_parser("replay", help="simulate a recorded JSONL workload trace")
    rep.add_argument("--trace", required=True)
    rep.add_argument("--policy", action="append")
    rep.add_argument("--out")
    sub.add_parser("policies", help="list the policy names")
    args = parser.parse_args(argv)
    if args.cmd == "policies":
        print("\n".join(available()))
        return 0
    if args.cmd == "replay":
        return _run(load_workload(Path(args.trace)), args.policy or [], args.out)
    scenario, policies = _scenario(args)
    if args.cmd == "record":
        save_workload(scenario, Path(args.out))
        print(f"wrote {len(scenario.trajectories)} trajectories to {args.out}", file=sys.stderr)
        return 0
    return _run(scenario, policies, args.out)
