"""What creating a Kubernetes pod costs, for the `static-pod` baseline (`PodStart` parameters).

Binding: kube-scheduler binds each pod with one API call through a client limited to `qps`
calls per second after a burst of `burst` (client-go's token bucket; a call that finds the
bucket empty waits for its token). Start-up: from binding to the container running, lognormal
with the given median and 99th percentile (the Kubernetes scalability SLO bounds p99 at 5 s for
stateless pods, excluding image pulls). The draw is a pure function of the trajectory id and the
seed, so every run of a scenario sees the same start-up times.
"""

from __future__ import annotations

import math
import random
import zlib

from scheduler.execution import PodStart

Z99 = 2.3263478740408408  # the standard normal's 99th percentile


class PodStarts:
    """The API server's binding rate and the kubelet's start-up time, in simulated seconds."""

    def __init__(self, spec: PodStart, seed: int = 0) -> None:
        self.spec = spec
        self.seed = seed
        self.tokens = float(spec.bind_burst)
        self.tokens_at_s = 0.0
        self.sigma = math.log(spec.start_p99_s / spec.start_p50_s) / Z99 if spec.start_p50_s > 0 else 0.0
        self.bind_wait_s: list[float] = []  # one per pod: time from creation to binding
        self.start_s: list[float] = []  # one per pod: time from binding to running

    def bind_at(self, now_s: float) -> float:
        """When a pod created at `now_s` is bound (reserving its token, like `rate.Limiter.Reserve`)."""
        qps = self.spec.bind_qps
        if qps is None:
            return now_s
        burst = float(self.spec.bind_burst)
        self.tokens = min(burst, self.tokens + (now_s - self.tokens_at_s) * qps)
        self.tokens_at_s = now_s
        self.tokens -= 1.0
        return now_s if self.tokens >= 0 else now_s - self.tokens / qps

    def startup_s(self, trajectory_id: str) -> float:
        """Seconds from binding to running for this trajectory's pod."""
        if self.spec.start_p50_s <= 0:
            return 0.0
        rng = random.Random(zlib.crc32(trajectory_id.encode()) ^ self.seed)
        return rng.lognormvariate(math.log(self.spec.start_p50_s), self.sigma)

    def ready_delay_s(self, now_s: float, trajectory_id: str) -> float:
        """Seconds until the pod created at `now_s` for `trajectory_id` runs its first command."""
        bound = self.bind_at(now_s)
        start = self.startup_s(trajectory_id)
        self.bind_wait_s.append(bound - now_s)
        self.start_s.append(start)
        return bound - now_s + start
