"""One scheduling round, the same for the simulator and the live service.

    fair ordering -> policy.decide -> one action per sandbox -> GPU batch riders -> CPU batch
        riders -> time sharers -> eviction plan -> core loans -> warm GPU placements

A `Round` wraps a policy the way Ray Serve's `_apply_autoscaling_config` wraps an autoscaling
policy: the rules every policy runs under are applied in one place, so that the simulator
(`scheduler.sim.engine`) and the live loop (`scheduler.service.loop`) cannot drift apart.
Both call `Round.plan(queue, state, now_s)` and carry the returned `RoundPlan` out in its
order: `ClusterState.apply` per allocation, `ClusterState.share` per rider,
`ClusterState.share_cores` per time sharer, the GPU loads on the state's residency
(`ClusterState.load_gpu`), and whatever their executor does besides
(starting simulated work, or persisting and sending Celery messages).

- **Fair ordering** (`scheduler.fairshare.order_queue`) across the jobs sharing the pools. With
  one job (the usual case, and every simulated scenario) the queue is handed to the policy as
  it is: the indexed `WaitingQueue`, on which the elastic policies' round is benchmarked.
- **One action per sandbox** (`one_per_sandbox`): a CPU allocation of a trajectory whose
  sandbox another of its actions holds (running, or allocated earlier in the round) is held
  back; it waits, or rides behind that action.
- **Riders**: a GPU allocation takes along up to `max_batch(service) - 1` waiting actions of
  the same service that accept its DoP, on its chunk (FCFS among them); they need no units of
  their own, the worker scores them in one batch with the leader.
- **CPU riders** (`cpu_batch`, `scheduler.policies.cpu_batch`): while actions wait that no
  free core can take, an allocation of a short CPU action takes along short waiting actions
  that would run on its node next; the worker runs them back to back on its cores, from one
  message. A rider is pinned and reserves memory (evicting idle trajectories) like any CPU
  action; it needs no cores of its own.
- **Time sharers** (policies whose execution model has `time_share`,
  `scheduler.policies.time_share`): under saturation, short rigid CPU actions start on cores
  held by a running action (preferably a wide, long one), time-sharing them at bounded CPU
  weights; they take no free core. A sharer is pinned and reserves memory like any CPU action.
- **Eviction plan**: CPU memory is a cache (`scheduler.eviction`): the idle trajectories the
  allocations evict, per node. GPU services are evicted on execution (`scheduler.gpu_cache`):
  for each GPU allocation, a hit or a restore with its victims, planned in order on copies of
  the state's GPU caches with the one LRU rule (`gpu_cache.lru_victims`).
- **Core loans** (policies whose execution model has `lend_cores`): the cores no allocation
  takes are lent to running malleable actions, and lent cores an allocation takes are taken
  back (`scheduler.policies.malleable`). A lent core stays free in the `ClusterState`, so no
  policy decision depends on loans.
- **Warm GPU placements** (`warm_gpu`): while no GPU call waits, services with expected demand
  (learned from the calls started, seeded from the services configured) are restored onto free
  chunks with free memory (`scheduler.policies.warm_gpu`); a warm restore holds its chunk.

The round sits above the policies (`scheduler.policies`), which it calls, and below its two
executors: core modules <- policies <- round <- simulator and service. `plan` holds the
`Round` and its `RoundPlan`, `steps` the steps around the policy (one per sandbox, GPU riders,
GPU loads), `loans` the core loans the round keeps.

Extending the round: a new kind of decision (resizing a running malleable action, say) is a
step here that adds to the `RoundPlan`, which both executors then carry out; what an executor
must be able to do for it is a field of the policy's `ExecutionModel` (`scheduler.execution`),
and `ExecutionModel.live_gaps` says when the live service cannot. The parity test
(tests/unit/test_round_parity.py) keeps the two executors honest.
"""

from scheduler.round.loans import Loans
from scheduler.round.plan import FairShareSpec, Round, RoundPlan
from scheduler.round.steps import MaxBatch, gpu_loads, one_per_sandbox, riders

__all__ = [
    "FairShareSpec",
    "Loans",
    "MaxBatch",
    "Round",
    "RoundPlan",
    "gpu_loads",
    "one_per_sandbox",
    "riders",
]
