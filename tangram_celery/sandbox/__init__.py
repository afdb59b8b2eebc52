"""Sandboxes for untrusted code: one interface, a Docker backend and a Linux-namespace backend."""

from tangram_celery.common.errors import SandboxError
from tangram_celery.sandbox.backends import docker_reachable, open_sandbox
from tangram_celery.sandbox.base import ExecRequest, ExecResult, Sandbox
from tangram_celery.sandbox.stage import SandboxScope

__all__ = [
    "ExecRequest",
    "ExecResult",
    "Sandbox",
    "SandboxError",
    "SandboxScope",
    "docker_reachable",
    "open_sandbox",
]
