"""Can a sandbox run here? Checked before anything starts (`tangram up`/`demo`, the tests).

Opens the configured backend exactly as a CPU worker would (private scope: nothing of anyone
else's is touched), runs one trivial action, and closes it. The answer is None, or the reason
with what to install or change.
"""

from __future__ import annotations

from tangram_celery.common.actions import ActionStatus
from tangram_celery.common.config import SandboxConfig
from tangram_celery.common.errors import SandboxError
from tangram_celery.sandbox.backends import open_sandbox
from tangram_celery.sandbox.base import ExecRequest


def check_sandbox(cfg: SandboxConfig) -> str | None:
    """None when a sandbox of `cfg` starts and runs `print(42)`, else why not."""
    try:
        box = open_sandbox(cfg)
    except SandboxError as e:
        return str(e)
    except OSError as e:  # e.g. the stage directory cannot be created (not root)
        return f"{e}; the sandbox needs root (or sandbox.backend: docker with a reachable engine)"
    try:
        res = box.run("tangram-preflight", ExecRequest(language="python", code="print(42)", timeout_s=30))
    except SandboxError as e:
        return str(e)
    finally:
        box.close()
    if res.status is not ActionStatus.OK or res.stdout.strip() != "42":
        return f"a trial action ended {res.status}: {res.detail or res.stderr[-500:]}"
    return None
