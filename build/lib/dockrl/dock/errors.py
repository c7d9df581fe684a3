"""Errors raised by the transfer dock."""


class DockError(ValueError):
    """Bad use of the dock: unknown column or consumer, row out of range, double write, wrong type."""


class DockTimeoutError(DockError, TimeoutError):
    """A claim waited longer than its timeout; the message names the columns still missing."""
