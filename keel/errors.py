"""The typed error tree of keel.

Every error that leaves a public API is a :class:`KeelError` with a stable
``code``. Messages say what was given and what is allowed.
"""

from __future__ import annotations

from collections.abc import Iterable

__all__ = [
    "BackendSelectionError",
    "DropIntegrityError",
    "ExecutionError",
    "InvalidArgumentError",
    "KeelError",
    "MemoryLimitError",
    "ModelFormatError",
    "UnsupportedOperationError",
    "VerificationError",
]


class KeelError(Exception):
    """Base of every error keel raises on purpose."""

    code: str = "KEEL_ERROR"

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message

    def __str__(self) -> str:
        return f"[{self.code}] {self.message}"


class BackendSelectionError(KeelError):
    """A requested backend target cannot run here; raised before any side effect."""

    code = "BACKEND_SELECTION"

    def __init__(self, target: str, reason: str) -> None:
        super().__init__(f"backend {target!r} cannot be used: {reason}")
        self.target = target
        self.reason = reason


class UnsupportedOperationError(KeelError):
    """An operation is not implemented by a backend (or by keel at all)."""

    code = "UNSUPPORTED_OPERATION"

    def __init__(
        self,
        op: str,
        backend: str | None = None,
        supported_on: Iterable[str] = (),
        detail: str = "",
    ) -> None:
        where = sorted(supported_on)
        text = f"operation {op!r} is not supported"
        if backend is not None:
            text += f" by backend {backend!r}"
        text += f"; supported on: {', '.join(where) if where else 'no backend'}"
        if detail:
            text += f" ({detail})"
        super().__init__(text)
        self.op = op
        self.backend = backend
        self.supported_on = tuple(where)


class InvalidArgumentError(KeelError, ValueError):
    """A bad shape, attribute, dtype, axis or value; also a ValueError."""

    code = "INVALID_ARGUMENT"


class ModelFormatError(KeelError):
    """A model file is unreadable, corrupt, truncated or hostile."""

    code = "MODEL_FORMAT"


class VerificationError(KeelError):
    """The IR is malformed (dangling value, cycle, type mismatch)."""

    code = "VERIFICATION"


class MemoryLimitError(KeelError):
    """The work cannot fit the memory budget, even in the smallest chunk."""

    code = "MEMORY_LIMIT"

    def __init__(self, message: str, required_bytes: int | None = None,
                 limit_bytes: int | None = None) -> None:
        super().__init__(message)
        self.required_bytes = required_bytes
        self.limit_bytes = limit_bytes


class DropIntegrityError(KeelError):
    """A drop's files do not match the sizes and hashes its manifest records."""

    code = "DROP_INTEGRITY"


class ExecutionError(KeelError):
    """A kernel failed at run time; names the node or op."""

    code = "EXECUTION"

    def __init__(self, message: str, node: str | None = None) -> None:
        super().__init__(message if node is None else f"node {node!r}: {message}")
        self.node = node
