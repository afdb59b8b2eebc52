"""Tenant caps in the scheduling round (issue 37): a tenant over its caps is held back for
itself alone, the others are placed as if its actions were not there, and without caps the
round decides exactly as before."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import pytest

from scheduler.duration import Amdahl
from scheduler.model import Allocation, CostVector, Elastic, QueuedAction, ResourceKind
from scheduler.policies import get_policy
from scheduler.queue import WaitingQueue
from scheduler.resources import ApiPool, ClusterState, CpuNode, GpuNode
from scheduler.round import FairShareSpec, Round, RoundPlan
from scheduler.service import SchedulerService
from scheduler.tenancy import TenantCaps, api_limit, refusal
from tangram_celery.client.sync import TangramClient
from tangram_celery.common.actions import ApiAction, CodeAction
from tangram_celery.common.config import parse_config
from tangram_celery.common.tenants import PRIORITY_OF_CLASS, Quotas, TenantRecord
from tangram_celery.common.wire import ActionMeta, TaskOrder
from tangram_celery.store import akey
from tangram_celery.store.keys import limits_key
from tangram_celery.testing import MemoryStore, memory_app, memory_store, sent_messages
from tests.unit.test_service_loop import Harness


def cpu(
    aid: str, job: str, t: float = 0.0, units: tuple[int, ...] = (1,), mem: int = 0, prio: int = 0
) -> QueuedAction:
    eff = Amdahl(0.95) if len(units) > 1 else Amdahl(1.0)
    cost = CostVector(ResourceKind.CPU, Elastic(units), memory_mb=mem)
    return QueuedAction(aid, f"t-{aid}", cost, t, t1_s=10.0, efficiency=eff, job_id=job, priority=prio)


def gpu(aid: str, job: str, t: float = 0.0, gmem: int = 500) -> QueuedAction:
    cost = CostVector(ResourceKind.GPU, Elastic((1,)), gpu_memory_mb=gmem)
    return QueuedAction(aid, f"t-{aid}", cost, t, kind="reward:rm", target="rm", job_id=job)


def api(aid: str, job: str, t: float = 0.0, quota: int = 1) -> QueuedAction:
    cost = CostVector(ResourceKind.API, Elastic((1,)), api_quota=quota)
    return QueuedAction(aid, f"t-{aid}", cost, t, kind="api:calc", target="calc", job_id=job)


def cpus(cores: int = 8, memory_mb: int = 100_000) -> ClusterState:
    return ClusterState(cpu={"n": CpuNode.uniform("n", cores, memory_mb)})


def started(plan: RoundPlan) -> list[str]:
    return sorted(a.action_id for a in plan.started)


def plan_of(
    policy: str,
    actions: Sequence[QueuedAction],
    state: ClusterState,
    caps: dict[str, TenantCaps],
    **kw: object,
) -> RoundPlan:
    rnd = Round(get_policy(policy), fair=FairShareSpec(), **kw)  # type: ignore[arg-type]
    rnd.tenancy.set_caps(caps)
    return rnd.plan(WaitingQueue(actions), state, 1.0)


def run(rnd: Round, q: WaitingQueue, state: ClusterState, now_s: float) -> RoundPlan:
    """One round, carried out on `state` and `q` as an executor does."""
    plan = rnd.plan(q, state, now_s)
    for a in plan.allocs:
        state.apply(a, q.action(a.action_id), now_s)
    for a in plan.riders:
        state.share(a, q.action(a.action_id), now_s)
    for a in plan.started:
        q.pop(a.action_id)
    return plan


def test_a_tenant_at_its_core_cap_waits_and_the_others_go_on() -> None:
    """Given tenant a (2 cores at most) with 6 one-core actions queued ahead of tenant b's 4 on
    8 free cores, a starts 2 and b all 4: a's held actions block nobody and stay queued."""
    q = [cpu(f"a{i}", "a", i * 0.01) for i in range(6)] + [cpu(f"b{i}", "b", 1 + i * 0.01) for i in range(4)]
    plan = plan_of("fcfs-min", q, cpus(8), {"a": TenantCaps(cores=2)})
    assert started(plan) == ["a0", "a1", "b0", "b1", "b2", "b3"]


def test_cores_held_by_running_actions_count_and_come_back() -> None:
    """Given tenant a holding its 2 cores, its next actions wait while b's start; once one of
    a's actions ends, the next round starts one more of a's."""
    state = cpus(8)
    rnd = Round(get_policy("fcfs-min"), fair=FairShareSpec())
    rnd.tenancy.set_caps({"a": TenantCaps(cores=2)})
    q = WaitingQueue([cpu(f"a{i}", "a", i * 0.01) for i in range(4)])
    assert started(run(rnd, q, state, 1.0)) == ["a0", "a1"]
    q.append(cpu("b0", "b", 2.0))
    assert started(run(rnd, q, state, 2.0)) == ["b0"]
    assert rnd.tenancy.held == {"a": 2} and len(q) == 2  # held, not dropped
    state.release("a0")
    assert started(run(rnd, q, state, 3.0)) == ["a2"]
    q.pop("a3")  # withdrawn: nothing of a's waits, nothing is held
    run(rnd, q, state, 4.0)
    assert rnd.tenancy.held == {}


@pytest.mark.parametrize("policy", ["tangram-fast", "tangram-dp", "fcfs-min"])
def test_elastic_actions_of_a_capped_tenant_stay_within_its_cores(policy: str) -> None:
    """Given tenant a (4 cores) with two elastic 1..8 test suites and 16 free cores, a's
    allocations hold 4 cores at most (an elastic action is offered only what fits) and at least
    one of them starts; tenant b's suite takes the rest."""
    q = [cpu("a0", "a", 0.0, tuple(range(1, 9))), cpu("a1", "a", 0.1, tuple(range(1, 9)))]
    q.append(cpu("b0", "b", 0.2, tuple(range(1, 9))))
    plan = plan_of(policy, q, cpus(16), {"a": TenantCaps(cores=4)})
    held_by_a = sum(a.units for a in plan.started if a.action_id.startswith("a"))
    assert 1 <= held_by_a <= 4
    assert "b0" in started(plan)


def test_memory_and_gpu_memory_caps() -> None:
    """Given caps of 1024 MB of sandbox memory and 1000 MB of GPU memory, tenant a starts two
    512 MB sandboxes and two 500 MB GPU calls; tenant b, uncapped, starts all of its."""
    q = [cpu(f"a{i}", "a", i * 0.01, mem=512) for i in range(3)] + [cpu("b0", "b", 0.5, mem=512)]
    q += [gpu(f"ga{i}", "a", 1 + i * 0.01) for i in range(3)] + [gpu("gb0", "b", 2.0)]
    state = cpus(8)
    state.gpu = {"g": GpuNode("g", 8, 80_000)}
    plan = plan_of("fcfs-min", q, state, {"a": TenantCaps(memory_mb=1024, gpu_memory_mb=1000)})
    assert started(plan) == ["a0", "a1", "b0", "ga0", "ga1", "gb0"]


def test_gpu_riders_count_against_the_cap() -> None:
    """Given a batch of 4 per call and tenant a allowed 1000 MB of GPU memory (two calls),
    a's calls on one GPU take at most one rider; b's call takes three."""
    q = [gpu(f"ga{i}", "a", i * 0.01) for i in range(4)] + [
        gpu(f"gb{i}", "b", 1 + i * 0.01) for i in range(4)
    ]
    state = ClusterState(gpu={"g": GpuNode("g", 2, 80_000)})
    plan = plan_of("fcfs-min", q, state, {"a": TenantCaps(gpu_memory_mb=1000)}, max_batch=lambda s: 4)
    assert started(plan) == ["ga0", "ga1", "gb0", "gb1", "gb2", "gb3"]


def test_api_share_of_concurrency_rounds_down_to_at_least_one() -> None:
    """Given an API of 4 concurrent calls, tenant a with half of it starts 2 and tenant c with
    a tenth starts 1 (at least one); b, without a share, takes the one left."""
    assert api_limit(4, 0.5) == 2 and api_limit(4, 0.1) == 1 and api_limit(4, 2.0) == 4
    assert api_limit(None, 0.5) is None
    q = [api(f"a{i}", "a", i * 0.01) for i in range(4)] + [
        api(f"c{i}", "c", 0.5 + i * 0.01) for i in range(3)
    ]
    q += [api(f"b{i}", "b", 1 + i * 0.01) for i in range(3)]
    state = ClusterState(api={"calc": ApiPool("calc", max_concurrency=4)})
    caps = {"a": TenantCaps(api_share={"calc": 0.5}), "c": TenantCaps(api_share={"calc": 0.1})}
    plan = plan_of("fcfs-min", q, state, caps)
    assert started(plan) == ["a0", "a1", "b0", "c0"]


def test_api_share_of_the_rate() -> None:
    """Given an API of 10 tokens a minute, tenant a with 30% of it spends 3 tokens, then waits
    for its own bucket to refill (b's calls are not held by it)."""
    state = ClusterState(api={"calc": ApiPool("calc", quota_per_window=10, window_s=60.0)})
    rnd = Round(get_policy("fcfs-min"), fair=FairShareSpec())
    rnd.tenancy.set_caps({"a": TenantCaps(api_share={"calc": 0.3})})
    q = WaitingQueue([api(f"a{i}", "a", i * 0.01) for i in range(5)] + [api("b0", "b", 0.5)])
    assert started(run(rnd, q, state, 1.0)) == ["a0", "a1", "a2", "b0"]
    for aid in ("a0", "a1", "a2", "b0"):
        state.release(aid)
    assert started(run(rnd, q, state, 2.0)) == []  # the pool has tokens; a's bucket has none
    assert started(run(rnd, q, state, 22.0)) == ["a3"]  # 3 tokens per 60 s: one per 20 s


def test_an_action_its_caps_can_never_hold_is_refused() -> None:
    """An action that needs more than its tenant may hold at all (cores, memory, GPU memory,
    API tokens per window) has a refusal saying so; one that fits, or has no caps, has none."""
    pools = {"calc": ApiPool("calc", quota_per_window=10)}
    caps = TenantCaps(cores=2, memory_mb=1024, gpu_memory_mb=500, api_share={"calc": 0.2})
    assert "needs 4 cores" in str(refusal(cpu("x", "a", units=(4, 8)), caps, pools))
    assert "2048 MB of memory" in str(refusal(cpu("x", "a", mem=2048), caps, pools))
    assert "GPU memory" in str(refusal(gpu("x", "a", gmem=600), caps, pools))
    assert "share is 2" in str(refusal(api("x", "a", quota=3), caps, pools))
    for fits in (cpu("x", "a", units=(1, 8), mem=512), gpu("x", "a"), api("x", "a", quota=2)):
        assert refusal(fits, caps, pools) is None
    assert refusal(cpu("x", "a", units=(64,)), None, pools) is None


def test_default_job_and_uncapped_tenants_are_never_held() -> None:
    """Caps given to the default job, or caps that limit nothing, hold nothing back."""
    rnd = Round(get_policy("fcfs-min"))
    rnd.tenancy.set_caps({"default": TenantCaps(cores=1), "b": TenantCaps()})
    assert rnd.tenancy.caps == {}
    q = WaitingQueue([cpu(f"d{i}", "default", i * 0.01) for i in range(3)])
    assert started(rnd.plan(q, cpus(4), 1.0)) == ["d0", "d1", "d2"]


def _allocs(plan: RoundPlan) -> list[Allocation]:
    return plan.started


@pytest.mark.parametrize("policy", ["tangram-fast", "tangram-dp", "fcfs-min"])
def test_without_capped_tenants_queued_the_round_is_unchanged(policy: str) -> None:
    """Given caps only for a tenant with nothing queued, every round's allocations equal those
    of a round without caps (and the policy is handed the very queue object)."""
    q = [cpu(f"x{i}", "x", i * 0.01, (1, 2, 4), mem=256) for i in range(10)]
    q += [cpu(f"y{i}", "y", 0.05 + i * 0.01) for i in range(6)]
    plain = plan_of(policy, q, cpus(8, 2048), {})
    capped = plan_of(policy, q, cpus(8, 2048), {"z": TenantCaps(cores=1)})
    assert _allocs(plain) == _allocs(capped)
    seen: list[object] = []
    inner = get_policy(policy)

    class Seen:
        name, execution = inner.name, inner.execution

        def decide(
            self, queue: Sequence[QueuedAction], state: ClusterState, now_s: float
        ) -> list[Allocation]:
            seen.append(queue)
            return inner.decide(queue, state, now_s)

    rnd = Round(Seen())
    rnd.tenancy.set_caps({"z": TenantCaps(cores=1)})
    wq = WaitingQueue(cpu(f"x{i}", "x", i * 0.01) for i in range(3))
    rnd.plan(wq, cpus(8), 1.0)
    assert seen == [wq]


def test_a_high_class_tenant_goes_first_among_equals() -> None:
    """Given two tenants whose actions came at the same time, the one whose class is `high`
    (its priority set from `PRIORITY_OF_CLASS` at intake) gets the one free core; `low` waits
    behind `normal`."""
    q = [
        cpu("l0", "low-t", 0.0, prio=PRIORITY_OF_CLASS["low"]),
        cpu("n0", "normal-t", 0.0, prio=PRIORITY_OF_CLASS["normal"]),
        cpu("h0", "high-t", 0.0, prio=PRIORITY_OF_CLASS["high"]),
    ]
    assert started(plan_of("fcfs-min", q, cpus(1), {})) == ["h0"]
    assert started(plan_of("fcfs-min", q, cpus(2), {})) == ["h0", "n0"]


# ---- the scheduler service: the registry's quotas, on the in-memory twin of the store ----------


def _service(tmp: str, store: MemoryStore) -> SchedulerService:
    cfg = parse_config(
        {
            "state_dir": tmp,
            "nodes": {"cpu": [{"name": "n0", "cores": 4, "memory_mb": 4096}]},
            "scheduler": {"policy": "fcfs-min"},
        }
    )
    return SchedulerService(cfg, "memory://", store=store, app=memory_app(), record=False)


def _gauge(svc: SchedulerService, tenant: str, state: str) -> float | None:
    return svc.metrics.registry.get_sample_value("tangram_tenant_actions", {"tenant": tenant, "state": state})


def test_the_book_publishes_max_queued_and_gives_the_round_its_caps(tmp_path: Path) -> None:
    """Given tenants a (at most 2 queued, 1 core) and b (no limits), a sync writes a's
    `<prefix>limits` and none of b's, and the round holds a's caps; when the operator lifts a's
    queue cap, and then removes a, its limits key goes and so do its caps."""
    store = memory_store()
    store.put_tenant(TenantRecord(name="a", quotas=Quotas(max_queued=2, max_cores=1)))
    store.put_tenant(TenantRecord(name="b"))
    store.r.hset(limits_key("b"), "max_queued", 9)  # left by an earlier run: cleaned up
    svc = _service(str(tmp_path), store)
    book, rnd = svc.dispatcher.tenants, svc.round
    book.sync(rnd)
    assert store.r.hgetall(limits_key("a")) == {"max_queued": "2"} and not store.r.exists(limits_key("b"))
    assert limits_key("a") == "tangram:t:a:limits" and rnd.tenancy.caps == {"a": TenantCaps(cores=1)}
    store.put_tenant(TenantRecord(name="a", quotas=Quotas(max_cores=1)))
    book.sync(rnd)
    assert not store.r.exists(limits_key("a")) and rnd.tenancy.caps == {"a": TenantCaps(cores=1)}
    store.put_tenant(TenantRecord(name="a", quotas=Quotas(max_queued=5)))
    book.sync(rnd)
    assert store.r.hget(limits_key("a"), "max_queued") == "5" and rnd.tenancy.caps == {}
    store.remove_tenant("a")
    book.sync(rnd)
    assert not store.r.exists(limits_key("a"))


def test_the_service_holds_a_capped_tenant_back_and_counts_it(tmp_path: Path) -> None:
    """Given tenant a allowed 1 core with 3 code actions queued and tenant b's 2 behind them on
    4 cores, one step dispatches one of a's and both of b's; the gauges say a has 1 running and
    2 queued, held back."""
    store = memory_store()
    store.put_tenant(TenantRecord(name="a", quotas=Quotas(max_cores=1)))
    store.put_tenant(TenantRecord(name="b"))
    svc = _service(str(tmp_path), store)
    svc.start()
    book, rnd = svc.dispatcher.tenants, svc.round
    book.sync(rnd)
    for job, n, t in (("a", 3, 0.0), ("b", 2, 1.0)):
        for i in range(n):
            qa = cpu(f"{job}/x{i}", job, t + i * 0.01, mem=256)
            qa.trajectory_id = f"{job}/t{i}"
            meta = _meta(qa)
            store.r.hset(akey(qa.action_id), mapping={"meta": meta.model_dump_json(), "state": "queued"})
            svc.books.admit(meta, qa)
    sent_messages(svc.sender.app, "tangram.cpu.n0")  # the memory transport is the process's: drain it
    assert svc.schedule() == 3
    assert sorted(svc.state.running) == ["a/x0", "b/x0", "b/x1"]
    book.sync(rnd, svc.books)
    assert _gauge(svc, "a", "running") == 1 and _gauge(svc, "a", "queued") == 2
    assert _gauge(svc, "a", "held") == 2 and _gauge(svc, "b", "running") == 2
    assert _gauge(svc, "default", "queued") == 0
    # what Flower shows of a task is its arguments: ids and the order, never a payload
    sent = sent_messages(svc.sender.app, "tangram.cpu.n0")
    assert sorted(args[0] for _, args in sent) == ["a/x0", "b/x0", "b/x1"]
    for _, args in sent:
        assert len(args) == 2 and set(args[1]) <= set(TaskOrder.model_fields)


def _meta(qa: QueuedAction) -> ActionMeta:
    return ActionMeta(
        id=qa.action_id,
        type="code",
        trajectory_id=qa.trajectory_id,
        job_id=qa.job_id,
        submitted_s=qa.submitted_s,
        cpus=(1, 1),
        memory_mb=qa.cost.memory_mb,
    )


# ---- end to end on the twin: tenant clients, the scheduler's intake per tenant, the round ------


def _harness(tmp: str, **quotas: Quotas) -> tuple[Harness, dict[str, TangramClient]]:
    h = Harness(tmp)
    h.svc.start()
    for name, q in quotas.items():
        h.store.put_tenant(TenantRecord(name=name, quotas=q))
    h.svc.sync_tenants()  # the intakes to read
    h.svc.dispatcher.tenants.sync(h.svc.round)  # the caps
    clients = {
        name: TangramClient("memory://", config=h.cfg, store=memory_store(h.store.server, tenant=name))
        for name in quotas
    }
    return h, clients


def _drain(h: Harness) -> list[str]:
    out = [aid for q in ("tangram.cpu.n0", "tangram.cpu.n1") for aid, _ in h.messages(q)]
    return sorted(out + [aid for aid, _ in h.messages("tangram.api.calc")])


def test_a_tenants_core_cap_holds_its_own_submits_back(tmp_path: Path) -> None:
    """Given tenant a allowed 1 core and tenant b without caps, each submitting code actions
    on 4 free cores (a first), one step dispatches one of a's and all 3 of b's: a's others stay
    queued, and go once its running action ends."""
    h, c = _harness(str(tmp_path), a=Quotas(max_cores=1), b=Quotas())
    for name in ("a", "b"):
        for i in range(3):
            c[name].submit(CodeAction(id=f"x{i}", trajectory_id=f"t{i}", code="print(1)"))
    h.svc.step(block_ms=None)
    assert _drain(h) == ["a/x0", "b/x0", "b/x1", "b/x2"]
    assert sorted(qa.action_id for qa in h.svc.waiting) == ["a/x1", "a/x2"]
    h.svc.state.release("a/x0")  # as its completion would
    h.svc.schedule()
    assert _drain(h) == ["a/x1"]


def test_a_high_class_tenant_is_served_first(tmp_path: Path) -> None:
    """Given one API slot and two tenants submitting at once, the tenant of class `high` is
    dispatched before the one of class `low`, although `low` submitted first."""
    h, c = _harness(str(tmp_path), lo=Quotas(priority="low"), hi=Quotas(priority="high"))
    c["lo"].submit(ApiAction(id="x1", api="calc", request={}))
    c["hi"].submit(ApiAction(id="x1", api="calc", request={}))
    h.svc.step(block_ms=None)
    assert _drain(h) == ["hi/x1"]
