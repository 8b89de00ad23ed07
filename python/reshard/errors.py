"""The exceptions reshard raises. Part of the public contract (DESIGN.md)."""


class LayoutError(ValueError):
    """Bad geometry: gaps, pieces out of range, shape mismatch, unknown locations."""


class PreflightError(RuntimeError):
    """A transfer was rejected before any target byte was written.

    Raised on every rank of the group with the same message, which names each
    failing rank and its reasons.
    """

    def __init__(self, message, failures=None):
        super().__init__(message)
        # {rank: [reason, ...]} for every rank that failed its local checks.
        self.failures = dict(failures or {})


class TransferError(RuntimeError):
    """A failure after writes began: targets may be partially written."""


class NotReadyError(RuntimeError):
    """The state asked for does not exist yet (e.g. Adam moments before the first step)."""


class UnsupportedError(RuntimeError):
    """A configuration reshard does not handle (e.g. NVMe offload); the message says what to change."""
