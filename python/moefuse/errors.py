"""Exceptions carrying the library's status and message."""

from . import _capi


class Error(RuntimeError):
    """A moefuse call failed. `status` is the C status name ("MOEFUSE_ERR_SHAPE"),
    `code` its number, and str(error) the library's message."""

    def __init__(self, status, message):
        self.code = int(status)
        self.status = (_capi.STATUS_NAMES[self.code]
                       if 0 <= self.code < len(_capi.STATUS_NAMES) else "unknown status")
        self.message = message
        super().__init__(f"{self.status}: {message}")


class NullPointerError(Error, ValueError):
    pass


class InvalidArgumentError(Error, ValueError):
    pass


class ShapeError(Error, ValueError):
    pass


class DtypeError(Error, TypeError):
    pass


class StrideError(Error, ValueError):
    pass


class AlignmentError(Error, ValueError):
    pass


class WrongDeviceError(Error, ValueError):
    pass


class UnsupportedError(Error, NotImplementedError):
    pass


class BackendUnavailableError(Error):
    pass


class OutOfMemoryError(Error, MemoryError):
    pass


class BackendFailureError(Error):
    pass


class InternalError(Error):
    pass


class OutOfBoundsError(Error, IndexError):
    pass


class OverlapError(Error, ValueError):
    pass


class ContextBusyError(Error):
    pass


class WorkspaceTooSmallError(Error, MemoryError):
    pass


# Indexed by status code (0 is MOEFUSE_OK and never raised).
_BY_CODE = (None, NullPointerError, InvalidArgumentError, ShapeError, DtypeError, StrideError,
            AlignmentError, WrongDeviceError, UnsupportedError, BackendUnavailableError,
            OutOfMemoryError, BackendFailureError, InternalError, OutOfBoundsError, OverlapError,
            ContextBusyError, WorkspaceTooSmallError)
assert len(_BY_CODE) == len(_capi.STATUS_NAMES)


def make(status, message):
    """The exception for a status code."""
    status = int(status)
    cls = _BY_CODE[status] if 0 < status < len(_BY_CODE) else Error
    return cls(status, message)


def code_of(name):
    """Status code of "MOEFUSE_ERR_SHAPE" and so on."""
    return _capi.STATUS_NAMES.index(name)
