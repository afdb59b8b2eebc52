"""The Kubernetes manifests (k8s/, tangram_celery.deploy.k8s), validated offline: every rendered
object against the Kubernetes schemas (kubernetes-validate, strict) or, for KEDA's ScaledObject,
against the CRD's vendored openAPIV3Schema; the autoscaling queries against the metrics
Tangram defines; and the demand gauge they read (`tangram_queued_units`). No cluster runs them.
"""

from __future__ import annotations

import copy
import json
import re
from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate
import pytest
import yaml
from prometheus_client import CollectorRegistry

from scheduler.model import CostVector, Elastic, QueuedAction, ResourceKind
from scheduler.resources import ClusterState, CpuNode
from scheduler.service.record import RunRecorder
from tangram_celery.common.config import parse_config
from tangram_celery.common.metrics import SchedulerMetrics, WorkerMetrics
from tangram_celery.deploy import k8s

pytestmark = pytest.mark.unit

K8S_VERSION = "1.33"  # a release every supported cluster is at least: fields newer than it fail
KEDA_SCHEMA = k8s.SOURCE / "schemas" / "keda.sh_scaledobject_v1alpha1.json"
VARIANTS = [
    {},
    {
        "redis": "external",
        "redis_url": "rediss://${TANGRAM_REDIS_USER}:${TANGRAM_REDIS_PASSWORD}@redis.example.com:6380/0",
    },
    {"sandbox_cgroups": "off", "cpu_min": "0", "gpu_min": "0", "namespace": "rl-sandboxes"},
]


def _strict(schema: Any) -> Any:
    """The CRD schema as `kubectl apply` (field validation Strict) applies it: an object that
    lists its properties and does not preserve unknown fields takes no others."""
    if isinstance(schema, dict):
        out = {k: _strict(v) for k, v in schema.items()}
        if (
            out.get("type") == "object"
            and "properties" in out
            and "additionalProperties" not in out
            and not out.get("x-kubernetes-preserve-unknown-fields")
        ):
            out["additionalProperties"] = False
        return out
    if isinstance(schema, list):
        return [_strict(v) for v in schema]
    return schema


KEDA = jsonschema.Draft7Validator(_strict(json.loads(KEDA_SCHEMA.read_text())))


def validate(obj: dict[str, Any]) -> None:
    """Raise on any schema error of `obj` (one Kubernetes object)."""
    if obj["apiVersion"].startswith("keda.sh/"):
        assert obj["apiVersion"] == "keda.sh/v1alpha1" and obj["kind"] == "ScaledObject"
        KEDA.validate(obj)
    else:
        kubernetes_validate.validate(obj, K8S_VERSION, strict=True)


def rendered(**overrides: str) -> list[dict[str, Any]]:
    return k8s.documents(k8s.render(k8s.resolve(dict(overrides))))


def by_kind(docs: list[dict[str, Any]], kind: str) -> dict[str, dict[str, Any]]:
    return {d["metadata"]["name"]: d for d in docs if d["kind"] == kind}


@pytest.mark.parametrize("overrides", VARIANTS, ids=["defaults", "external-redis", "no-cgroups"])
def test_every_rendered_object_passes_its_schema(overrides: dict[str, str]) -> None:
    """Given the default values and two variants, every rendered object is valid against the
    strict Kubernetes schemas or KEDA's CRD schema, and lives in the chosen namespace."""
    docs = rendered(**overrides)
    kinds = sorted({d["kind"] for d in docs})
    assert {"Deployment", "ScaledObject", "ConfigMap", "Secret", "Service", "Namespace"} <= set(kinds)
    for obj in docs:
        validate(obj)
        ns = overrides.get("namespace", "tangram")
        assert obj["metadata"].get("namespace", obj["metadata"]["name"]) == ns
    assert ("StatefulSet" in kinds) == (overrides.get("redis", "in-cluster") == "in-cluster")


def _so(docs: list[dict[str, Any]], pool: str) -> dict[str, Any]:
    spec: dict[str, Any] = by_kind(docs, "ScaledObject")[f"tangram-worker-{pool}"]["spec"]
    return spec


def _cpu_pod(docs: list[dict[str, Any]]) -> dict[str, Any]:
    spec: dict[str, Any] = by_kind(docs, "Deployment")["tangram-worker-cpu"]["spec"]["template"]["spec"]
    return spec


@pytest.mark.parametrize(
    ("break_it", "where"),
    [
        (lambda d: _cpu_pod(d).update(terminationGracePeriod=60), "a misspelt pod field"),
        (lambda d: _cpu_pod(d)["containers"][0]["securityContext"].update(privileged="yes"), "a wrong type"),
        (lambda d: _so(d, "cpu").update(minReplicaCnt=1), "a misspelt KEDA field"),
        (lambda d: _so(d, "gpu")["fallback"].pop("replicas"), "a required KEDA field missing"),
        (lambda d: _so(d, "api").update(maxReplicaCount=0), "a KEDA bound"),
        (lambda d: _so(d, "cpu")["triggers"][0].update(metadata={"query": 1}), "a KEDA type"),
        (lambda d: by_kind(d, "Service")["tangram-http"]["spec"]["ports"][0].update(port="http"), "a port"),
    ],
)
def test_a_broken_copy_fails_validation(break_it: Any, where: str) -> None:
    """Given a copy of the rendered objects with one deliberate mistake, validation fails: the
    check catches real errors, not only parses."""
    docs = copy.deepcopy(rendered())
    break_it(docs)
    with pytest.raises((kubernetes_validate.ValidationError, jsonschema.ValidationError)):
        for obj in docs:
            validate(obj)


def _metric_names(*metrics: Any) -> set[str]:
    return {fam.name for m in metrics for fam in m.registry.collect()}


def test_the_autoscaling_queries_read_metrics_the_scheduler_defines() -> None:
    """Every metric a ScaledObject's Prometheus query names is one the scheduler serves (the
    process KEDA's queries are about), and each threshold is one pod's units."""
    scheduler = _metric_names(SchedulerMetrics(CollectorRegistry()))
    assert "tangram_queued_units" in scheduler and "tangram_queued_actions" in scheduler
    everything = scheduler | _metric_names(WorkerMetrics(CollectorRegistry()))
    values = k8s.resolve({})
    per_pod = {"cpu": values["cpu_cores"], "gpu": values["gpus_per_worker"], "api": values["api_concurrency"]}
    objects = by_kind(rendered(), "ScaledObject")
    assert set(objects) == {"tangram-worker-cpu", "tangram-worker-gpu", "tangram-worker-api"}
    for name, so in objects.items():
        (trigger,) = so["spec"]["triggers"]
        assert trigger["type"] == "prometheus" and trigger["metricType"] == "AverageValue"
        meta = trigger["metadata"]
        named = set(re.findall(r"\b(tangram_[a-z_]+)\b", meta["query"]))
        assert named and named <= scheduler, (name, named - everything)
        assert meta["serverAddress"] == values["prometheus"]
        assert int(meta["threshold"]) == per_pod[name.rsplit("-", 1)[1]]
        # demand, not a Redis list length; a missing scheduler is an error, not "no demand"
        assert "queued_units" in meta["query"] and meta["ignoreNullValues"] == "false"
        assert so["spec"]["fallback"]["behavior"] == "currentReplicas"
        assert so["spec"]["scaleTargetRef"]["name"] in by_kind(rendered(), "Deployment")


def test_workers_drain_and_join_as_their_pod() -> None:
    """Worker pods get a grace period longer than the sandbox's default timeout, scale down one
    pod per grace period, and join under their pod's name (the downward API)."""
    docs = rendered()
    values = k8s.resolve({})
    grace = values["drain_grace_s"]
    cfg = parse_config(yaml.safe_load(by_kind(docs, "ConfigMap")["tangram-config"]["data"]["tangram.yaml"]))
    assert grace > cfg.sandbox.default_timeout_s
    deployments = by_kind(docs, "Deployment")
    for kind in ("cpu", "gpu"):
        pod = deployments[f"tangram-worker-{kind}"]["spec"]["template"]["spec"]
        assert pod["terminationGracePeriodSeconds"] == grace
        (c,) = pod["containers"]
        env = {e["name"]: e for e in c["env"]}
        assert env["TANGRAM_NODE"]["valueFrom"] == {"fieldRef": {"fieldPath": "metadata.name"}}
        assert c["args"][:4] == ["worker", kind, "--node", "$(TANGRAM_NODE)"]
        # the node lends what the pod is given (a cpu limit is a quota, not a cpuset)
        lend = {"cpu": ("--cores", "cpu_cores"), "gpu": ("--gpus", "gpus_per_worker")}[kind]
        assert c["args"][c["args"].index(lend[0]) + 1] == str(values[lend[1]])
    down = _so(docs, "cpu")["advanced"]
    policy = down["horizontalPodAutoscalerConfig"]["behavior"]["scaleDown"]["policies"]
    assert policy == [{"type": "Pods", "value": 1, "periodSeconds": grace}]
    gpu = deployments["tangram-worker-gpu"]["spec"]["template"]["spec"]["containers"][0]["resources"]
    assert gpu["limits"]["nvidia.com/gpu"] == gpu["requests"]["nvidia.com/gpu"] == "8"


def test_the_cpu_worker_gets_what_the_sandbox_needs_and_no_more() -> None:
    """host: privileged (the host's cgroup namespace); off: CAP_SYS_ADMIN, the runtime's
    seccomp profile and unconfined AppArmor, nothing else; the other pods run as non-root with
    no capabilities."""
    host = _cpu_pod(rendered())["containers"][0]["securityContext"]
    assert host == {"privileged": True, "runAsUser": 0, "allowPrivilegeEscalation": True}
    off = _cpu_pod(rendered(sandbox_cgroups="off"))["containers"][0]["securityContext"]
    assert off["capabilities"] == {"add": ["SYS_ADMIN"]} and "privileged" not in off
    assert off["seccompProfile"] == {"type": "RuntimeDefault"}
    assert off["appArmorProfile"] == {"type": "Unconfined"}
    for name, d in by_kind(rendered(), "Deployment").items():
        if name in ("tangram-worker-cpu", "tangram-worker-gpu"):
            continue
        pod = d["spec"]["template"]["spec"]
        assert pod["securityContext"]["runAsNonRoot"] is True, name
        assert pod["containers"][0]["securityContext"]["capabilities"] == {"drop": ["ALL"]}, name


def test_secrets_are_placeholders_and_every_reference_resolves() -> None:
    """The only Secret holds CHANGE-ME placeholders (and is left out of what stdout renders);
    every secretKeyRef and configMap a pod uses exists; the config is valid for Tangram."""
    files = k8s.render(k8s.resolve({}))
    docs = k8s.documents(files)
    (secret,) = by_kind(docs, "Secret").values()
    assert set(secret["stringData"].values()) == {"CHANGE-ME"}
    assert [n for n in files if "secret" in n] == ["examples/secret.yaml"]
    text = "".join(t for n, t in files.items() if not n.startswith("examples/"))
    for key in secret["stringData"]:
        assert f"key: {key}" in text
    for ref in re.findall(r"secretKeyRef: \{name: ([\w-]+), key: ([\w-]+)\}", text):
        assert ref[0] == secret["metadata"]["name"] and ref[1] in secret["stringData"]
    assert set(re.findall(r"configMap: \{name: ([\w-]+)\}", text)) == set(by_kind(docs, "ConfigMap"))
    cfg = parse_config(yaml.safe_load(by_kind(docs, "ConfigMap")["tangram-config"]["data"]["tangram.yaml"]))
    assert cfg.broker.url.startswith("redis://${TANGRAM_REDIS_USER}:${TANGRAM_REDIS_PASSWORD}@tangram-redis:")


def test_the_renderer_refuses_what_it_cannot_place(tmp_path: Path) -> None:
    """Unknown values, non-integers, bad choices, bounds and YAML-breaking text are errors, and
    the command line writes the files."""
    for bad, why in [
        ({"imag": "x"}, "unknown value"),
        ({"cpu_max": "many"}, "integer"),
        ({"redis": "elsewhere"}, "one of"),
        ({"cpu_min": "5", "cpu_max": "2"}, "cpu_min"),
        ({"image": "x # y"}, "plain value"),
        ({"namespace": "Tangram"}, "DNS label"),
    ]:
        with pytest.raises(k8s.RenderError, match=why):
            k8s.resolve(bad)
    with pytest.raises(k8s.RenderError, match="unknown placeholder"):
        k8s.substitute("a: {{ nope }}\n", {}, "t.yaml")
    assert k8s.main(["render", "--set", "image=registry.example:5000/tangram:1", "-o", str(tmp_path)]) == 0
    assert "image: registry.example:5000/tangram:1" in (tmp_path / "30-scheduler.yaml").read_text()
    assert (tmp_path / "examples" / "secret.yaml").exists()
    assert k8s.main(["render", "--set", "nope=1"]) == 2
    assert k8s.main(["render", "--source", str(tmp_path)]) == 2  # no values.yaml there


def test_queued_units_is_the_demand_per_pool_family() -> None:
    """Given waiting actions of each family, the scheduler's snapshot sets tangram_queued_units
    to the sum of their smallest unit counts per family (beside tangram_queued_actions), and
    back to 0 once they are gone."""
    registry = CollectorRegistry()
    rec = RunRecorder(None, SchedulerMetrics(registry))
    waiting = [
        QueuedAction("a", "t1", CostVector(ResourceKind.CPU, Elastic.range(2, 8)), 0.0),
        QueuedAction("b", "t2", CostVector(ResourceKind.CPU), 0.0),
        QueuedAction("c", "t3", CostVector(ResourceKind.GPU, Elastic((2, 4))), 0.0, target="judge"),
        QueuedAction("d", "t4", CostVector(ResourceKind.API), 0.0, target="search"),
    ]
    state = ClusterState(cpu={"n": CpuNode.uniform("n", 4, 10_000)})
    rec.snapshot(waiting, state, set())

    def units(pool: str) -> float | None:
        return registry.get_sample_value("tangram_queued_units", {"pool": pool})

    assert (units("cpu"), units("gpu:judge"), units("api:search")) == (3, 2, 1)
    assert registry.get_sample_value("tangram_queued_actions", {"pool": "cpu"}) == 2
    rec.snapshot([], state, set())
    assert (units("cpu"), units("gpu:judge"), units("api:search")) == (0, 0, 0)


def test_every_tangram_container_runs_a_command_tangram_accepts() -> None:
    """The args of every Tangram container parse with `tangram`'s own parser (a renamed or
    dropped flag fails here, not in a cluster), and each reads the mounted config."""
    from tangram_celery.cli import build_parser

    image = k8s.resolve({})["image"]
    seen = set()
    for d in by_kind(rendered(), "Deployment").values():
        for c in d["spec"]["template"]["spec"]["containers"]:
            if c["image"] != image:
                continue
            argv = [a.replace("$(TANGRAM_NODE)", "tangram-worker-cpu-5d8f9c7b6-x2k4q") for a in c["args"]]
            args = build_parser().parse_args(argv)
            assert args.config == "/etc/tangram/tangram.yaml"
            seen.add(argv[0] if argv[0] != "worker" else f"worker {argv[1]}")
    assert seen == {"scheduler", "serve", "flower", "worker cpu", "worker gpu", "worker api"}
