"""Sandboxes for untrusted code: one interface, a Docker backend and a Linux-namespace backend."""

from tangram_celery.sandbox.base import ExecRequest, ExecResult, Sandbox

__all__ = ["ExecRequest", "ExecResult", "Sandbox"]
