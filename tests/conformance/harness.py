"""Conformance cases: one op, generated inputs, attributes and tolerances.

Each family module ``cases_<family>.py`` exposes ``CASES: list[OpCase]``;
``test_conformance.py`` runs every case on every available backend against the
reference backend. This module also holds what that runner needs: case
collection, the known-failure lists of ``tests/known_failures/<backend>.txt``,
running a case on a backend and comparing outputs.

Known-failure files hold one entry per line, ``op[:case-id-glob]  reason``;
``#`` starts a comment. An entry without a glob covers every case of the op
(and says the backend has no kernel for it); a reason is required.
"""

from __future__ import annotations

import fnmatch
import importlib
import pkgutil
import zlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from keel.backends.base import Backend
from keel.dtypes import DType
from keel.ops.registry import Op

__all__ = [
    "KNOWN_FAILURES_DIR",
    "KnownFailure",
    "KnownFailures",
    "OpCase",
    "assert_outputs_match",
    "bitwise_equal",
    "case_rng",
    "collect_cases",
    "case_inputs",
    "parse_known_failures",
    "run_case",
]

KNOWN_FAILURES_DIR = Path(__file__).resolve().parent.parent / "known_failures"


@dataclass(frozen=True)
class OpCase:
    id: str
    op: Op
    inputs: Callable[[np.random.Generator], list[np.ndarray | None]]
    attrs: dict[str, Any] = field(default_factory=dict)
    rtol: float = 1e-5
    atol: float = 1e-6


def collect_cases() -> list[OpCase]:
    """Every ``CASES`` entry of every ``tests/conformance/cases_*.py`` module, in name order."""
    package = importlib.import_module("tests.conformance")
    names = sorted(m.name for m in pkgutil.iter_modules(package.__path__)
                   if m.name.startswith("cases_"))
    cases: list[OpCase] = []
    for name in names:
        module = importlib.import_module(f"tests.conformance.{name}")
        cases.extend(module.CASES)
    return cases


def case_rng(case: OpCase) -> np.random.Generator:
    """The same generator for a case on every backend, run and worker."""
    return np.random.default_rng(zlib.crc32(case.id.encode()))


# ---- known failures ---------------------------------------------------------

@dataclass(frozen=True)
class KnownFailure:
    op: Op
    glob: str | None            # None: every case of the op
    reason: str
    line: int


@dataclass(frozen=True)
class KnownFailures:
    backend: str
    entries: tuple[KnownFailure, ...]

    @classmethod
    def load(cls, backend: str, directory: Path = KNOWN_FAILURES_DIR) -> KnownFailures:
        path = directory / f"{backend}.txt"
        text = path.read_text(encoding="utf-8") if path.exists() else ""
        return cls(backend, parse_known_failures(text, str(path)))

    def match(self, op: Op, case_id: str) -> KnownFailure | None:
        for entry in self.entries:
            if entry.op is op and (entry.glob is None or fnmatch.fnmatchcase(case_id, entry.glob)):
                return entry
        return None

    def whole_ops(self) -> dict[Op, KnownFailure]:
        """Entries that cover every case of an op (the op has no kernel)."""
        return {e.op: e for e in self.entries if e.glob is None}


def parse_known_failures(text: str, where: str = "<text>") -> tuple[KnownFailure, ...]:
    """Parse ``op[:case-id-glob]  reason`` lines; a malformed line raises ``ValueError``."""
    entries = []
    for number, raw in enumerate(text.splitlines(), start=1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        parts = line.split(None, 1)
        if len(parts) < 2:
            raise ValueError(f"{where}:{number}: entry {parts[0]!r} has no reason")
        target, reason = parts[0], parts[1].strip()
        name, _, glob = target.partition(":")
        try:
            op = Op(name)
        except ValueError:
            raise ValueError(f"{where}:{number}: unknown op {name!r}") from None
        entries.append(KnownFailure(op, glob or None, reason, number))
    return tuple(entries)


# ---- running and comparing ----------------------------------------------------

def case_inputs(case: OpCase) -> list[np.ndarray | None]:
    """The case's inputs, generated afresh (the same values every time)."""
    return case.inputs(case_rng(case))


def run_case(backend: Backend, case: OpCase, *, make_strided: bool = False,
             variant: str = "default") -> list[np.ndarray]:
    """Run ``case`` on ``backend`` with freshly generated inputs; host copies of the outputs.

    NumPy backends get the case's arrays as they are (a non-contiguous case
    input stays non-contiguous) and must leave them unchanged. With
    ``make_strided`` every non-empty input is made non-contiguous on the
    backend's own device.
    """
    inputs = case_inputs(case)
    arrays = [_on_backend(backend, x, make_strided) for x in inputs]
    results = backend.run(case.op, arrays, None, case.attrs, variant=variant)
    backend.synchronize()
    outputs = [_read(backend, r) for r in results]
    if backend.xp is np and not make_strided:
        for i, (x, fresh) in enumerate(zip(inputs, case_inputs(case), strict=True)):
            assert x is None or (fresh is not None and bitwise_equal([x], [fresh])), \
                f"{case.id}: {backend.name} modified input {i}"
    return outputs


def _read(backend: Backend, result: Any) -> Any:
    """A result on the host; a sequence (a list) element by element, an empty optional None."""
    if result is None:
        return None
    if isinstance(result, list):
        return [backend.read(r) for r in result]
    return backend.read(result)


def _flat(values: Sequence[Any]) -> list[Any]:
    """Sequences (lists) spelled out into their elements, each after a marker of its length,
    so that two values compare equal only when their structure does."""
    flat: list[Any] = []
    for v in values:
        if isinstance(v, list):
            flat.append(np.array(len(v), dtype=np.int64))
            flat.extend(_flat(v))
        elif v is None:
            flat.append(np.array(-1, dtype=np.int64))
        else:
            flat.append(v)
    return flat


def _on_backend(backend: Backend, x: Any, make_strided: bool) -> Any:
    if isinstance(x, list):
        return [_on_backend(backend, item, make_strided) for item in x]
    if x is None:
        return None
    if make_strided and x.ndim >= 1 and x.size > 0:
        # The values sit every other element of a buffer twice as wide: the
        # same data, non-contiguous on the backend's own device.
        wide = np.zeros((*x.shape[:-1], 2 * x.shape[-1]), dtype=x.dtype)
        wide[..., ::2] = x
        if x.dtype == object and backend.xp is np:
            return wide[..., ::2]      # strings are host object arrays: no device copy
        return backend.to_device(wide)[..., ::2]
    return x if backend.xp is np else backend.to_device(x)


def assert_outputs_match(actual: Sequence[np.ndarray], expected: Sequence[np.ndarray],
                         case: OpCase, what: str = "") -> None:
    """Same count, dtypes and shapes; floats within the case's tolerance, others exact."""
    label = f"{case.id}{what}"
    actual, expected = _flat(actual), _flat(expected)
    assert len(actual) == len(expected), \
        f"{label}: {len(actual)} outputs, the reference gives {len(expected)}"
    for i, (a, e) in enumerate(zip(actual, expected, strict=True)):
        assert a.dtype == e.dtype, f"{label} output {i}: dtype {a.dtype}, reference {e.dtype}"
        assert a.shape == e.shape, f"{label} output {i}: shape {a.shape}, reference {e.shape}"
        if e.dtype.kind not in "OUS" and DType.from_numpy(e.dtype).is_narrow:
            # ml_dtypes' types: compared as the float32 values they hold (exact), NaN = NaN
            a, e = a.astype(np.float32), e.astype(np.float32)
        if e.dtype.kind in "fc":
            np.testing.assert_allclose(a, e, rtol=case.rtol, atol=case.atol, equal_nan=True,
                                       err_msg=f"{label} output {i}")
        else:
            np.testing.assert_array_equal(a, e, err_msg=f"{label} output {i}")


def bitwise_equal(a: Sequence[np.ndarray], b: Sequence[np.ndarray]) -> bool:
    """Same dtypes, shapes and bytes (NaNs included)."""
    a, b = _flat(a), _flat(b)
    return len(a) == len(b) and all(
        x.dtype == y.dtype and x.shape == y.shape
        and (x.tolist() == y.tolist() if x.dtype == object   # strings: by value
             else np.ascontiguousarray(x).tobytes() == np.ascontiguousarray(y).tobytes())
        for x, y in zip(a, b, strict=True))
