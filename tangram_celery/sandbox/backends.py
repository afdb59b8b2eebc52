"""Which sandbox backend a worker opens: the configured one, or for 'auto' Docker when an engine
answers, else namespaces."""

from __future__ import annotations

import logging
import os

from tangram_celery.common.config import SandboxConfig
from tangram_celery.common.errors import SandboxError
from tangram_celery.common.pretend import pretend_missing
from tangram_celery.sandbox.base import Sandbox
from tangram_celery.sandbox.stage import SandboxScope

log = logging.getLogger(__name__)


def docker_reachable(base_url: str | None) -> bool:
    """True when a Docker engine answers at `base_url` (None: DOCKER_HOST / default socket)."""
    from tangram_celery.sandbox.docker import connect

    if pretend_missing("docker"):
        return False
    try:
        connect(base_url, timeout_s=3.0).close()
    except SandboxError:
        return False
    return True


def open_sandbox(
    cfg: SandboxConfig, scope: SandboxScope | None = None, egress_deny: tuple[str, ...] = ()
) -> Sandbox:
    """The configured backend; 'auto' = Docker when an engine is reachable, else namespaces.

    `scope` names the deployment and node (`SandboxScope.of_node`): the backend then removes
    sandboxes a previous worker of the same node left behind. Without it, a private scope.
    `egress_deny`: addresses of the deployment's endpoints no sandbox may reach even when
    `sandbox.egress_allow` covers them (with `sandbox.network`; `egress.endpoint_addrs`)."""
    backend = cfg.backend
    if backend == "auto":
        url = cfg.docker_host or os.environ.get("DOCKER_HOST")
        backend = "docker" if docker_reachable(url) else "namespace"
        log.info(
            "sandbox backend 'auto' chose %r (docker engine %s)",
            backend,
            "reachable" if backend == "docker" else f"not reachable at {url or 'default'}",
        )
    if backend == "docker":
        from tangram_celery.sandbox.docker import DockerSandbox

        box: Sandbox = DockerSandbox(cfg, scope=scope, egress_deny=egress_deny)
    else:
        from tangram_celery.sandbox.namespace import NamespaceSandbox

        box = NamespaceSandbox(cfg, scope=scope, egress_deny=egress_deny)
    log.info(
        "sandbox backend: %s%s", box.name, f" ({box.launcher} launcher)" if hasattr(box, "launcher") else ""
    )
    start_prewarm = getattr(box, "start_prewarm", None)  # now that it is set up (probed, reaper armed)
    if start_prewarm is not None:
        start_prewarm()
    return box
