"""One error root, one sub-tree per boundary.

User-facing failures of an action (time limit, memory limit, non-zero exit, unknown model) are
*results* with a status, never exceptions from the worker. Exceptions are for the caller's bugs
(bad config, bad action) and for infrastructure that is down.
"""


class TangramError(Exception):
    """Root of every error Tangram raises."""


class ConfigError(TangramError):
    """The configuration is invalid; the message names the key, the bad value and the fix."""


class ActionRejected(TangramError):
    """An action failed validation at submit; nothing was enqueued."""


class BrokerError(TangramError):
    """The broker (Redis) cannot be started or reached."""


class SandboxError(TangramError):
    """The sandbox backend itself failed (not the user's code)."""


class RewardServerError(TangramError):
    """The reward server (Triton) or a model load failed."""


class AdmissionError(TangramError):
    """The intake is full: submit fails fast instead of the system falling over."""


class ResultTimeout(TangramError):
    """No result arrived within the caller's timeout (the action may still complete)."""
