"""onnxruntime's exception names, as keel's typed errors.

onnxruntime raises ``onnxruntime.capi.onnxruntime_pybind11_state.InvalidArgument``,
``NoSuchFile``, ``InvalidProtobuf`` and the like. keel raises the classes of the
same names from here: each is the keel error of that kind (``InvalidArgument`` is a
:class:`~keel.errors.InvalidArgumentError`, so also a ``ValueError``) and also a
``RuntimeError``, so ``except RuntimeError``, ``except Exception`` and
``except ort.capi.onnxruntime_pybind11_state.InvalidArgument`` all catch them.
"""

from __future__ import annotations

from keel.errors import (
    BackendSelectionError,
    ExecutionError,
    InvalidArgumentError,
    KeelError,
    ModelFormatError,
    UnsupportedOperationError,
)

__all__ = ["EPFail", "Fail", "InvalidArgument", "InvalidGraph", "InvalidProtobuf",
           "NoSuchFile", "NotImplemented", "RuntimeException", "as_ort_error"]


class _OrtError(KeelError, RuntimeError):
    """A keel error under onnxruntime's name; built from a message only."""

    def __init__(self, message: str) -> None:
        KeelError.__init__(self, message)


class Fail(_OrtError):
    """onnxruntime's ``FAIL``: the call could not be done."""

    code = "FAIL"


class InvalidArgument(_OrtError, InvalidArgumentError):
    """A bad input name, dtype, rank, shape, output name or option (also a ValueError)."""


class NoSuchFile(_OrtError, ModelFormatError):
    """The model file does not exist."""

    code = "NO_SUCHFILE"


class InvalidProtobuf(_OrtError, ModelFormatError):
    """The model's bytes are not an ONNX model."""

    code = "INVALID_PROTOBUF"


class InvalidGraph(_OrtError, ModelFormatError):
    """The model parses but its graph cannot be loaded."""

    code = "INVALID_GRAPH"


class NotImplemented(_OrtError, UnsupportedOperationError):
    """An op keel has no kernel for."""


class RuntimeException(_OrtError, ExecutionError):
    """A kernel failed while running."""

    code = "RUNTIME_EXCEPTION"


class EPFail(_OrtError, BackendSelectionError):
    """An execution provider (keel backend) cannot run here."""

    code = "EP_FAIL"


def as_ort_error(exc: KeelError) -> KeelError:
    """``exc`` under onnxruntime's name for its kind (its attributes kept); ``exc`` itself
    when it already is one or has no onnxruntime counterpart."""
    if isinstance(exc, _OrtError):
        return exc
    cls = _KINDS.get(type(exc))
    if cls is None:
        cls = next((c for base, c in _KINDS.items() if isinstance(exc, base)), None)
    if cls is None:
        return exc
    translated = cls(exc.message)
    translated.__dict__.update(exc.__dict__)
    return translated


_KINDS: dict[type[KeelError], type[_OrtError]] = {
    InvalidArgumentError: InvalidArgument,
    UnsupportedOperationError: NotImplemented,
    BackendSelectionError: EPFail,
    ExecutionError: RuntimeException,
    ModelFormatError: InvalidGraph,
}
