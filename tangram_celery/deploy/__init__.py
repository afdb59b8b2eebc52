"""Start and stop a whole local deployment: embedded Redis, scheduler, one worker per pool, Flower.

Used by `tangram up`, `tangram demo` and the integration tests. Every child is a real process
started here and stopped here by its pid. Nothing outlives this process: every child is started
from one long-lived thread and arms a parent-death signal, then checks that this process still
lives (`tangram_celery/common/lifeline.py`): Python children from their entry point, Redis and Flower
through the exec wrapper. A start that fails part-way stops what it had started.

- `stack`: `Deployment`, the stack started in order and supervised;
- `children`: one child process: start, watch, restart budget, stop;
- `readiness`: ready when every worker answers and the reward services are warm;
- `http_child`: the HTTP server's URL and its port kept across restarts;
- `flower`: the Flower monitor's command line.
"""

from __future__ import annotations

from tangram_celery.deploy.children import Child
from tangram_celery.deploy.flower import flower_command, pool_queues
from tangram_celery.deploy.http_child import HTTP_PORT_FILE
from tangram_celery.deploy.readiness import gpu_worker_nodes, wait_warm, warm_nodes
from tangram_celery.deploy.stack import Deployment, write_config

__all__ = [
    "HTTP_PORT_FILE",
    "Child",
    "Deployment",
    "flower_command",
    "gpu_worker_nodes",
    "pool_queues",
    "wait_warm",
    "warm_nodes",
    "write_config",
]
