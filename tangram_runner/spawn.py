"""The runner's handle on the zygote (see `zygote`): a fork server (`forkserver`) that owns the
pool of verifiers it forks (`verifiers`)."""

from __future__ import annotations

import os
import signal
import socket

from tangram_runner.forkserver import ForkServer, fork_zygote
from tangram_runner.verifiers import VerifierPool


class Zygote(ForkServer):
    """The runner's handle on the zygote process (see zygote)."""

    name = "zygote"

    def __init__(self) -> None:
        super().__init__()
        self.verifiers = VerifierPool(self)

    def start(self) -> None:
        """Start a zygote exec'd fresh (a replacement: the runner's first one is forked from it
        before it serves, `runner.main`, and adopted)."""
        self.adopt(fork_zygote(pristine=False))

    def adopt(self, started: tuple[int, socket.socket]) -> None:
        """Take over a zygote `fork_zygote` started (the runner's, before it loaded its own
        modules)."""
        self.pid, self.sock = started
        self.ready = False

    def lost(self) -> None:
        """The zygote is dead (killed with everything else, or it crashed); start another later.
        Its verifiers' seed is its child: it goes too."""
        super().lost()
        self.verifiers.forget()

    def _ended(self) -> bool:
        assert self.pid is not None
        try:
            pid, _ = os.waitpid(self.pid, os.WNOHANG)
        except ChildProcessError:
            return True
        return bool(pid)

    def _kill(self) -> None:
        assert self.pid is not None
        try:
            os.kill(self.pid, signal.SIGKILL)
            os.waitpid(self.pid, 0)
        except (ProcessLookupError, ChildProcessError):
            pass
