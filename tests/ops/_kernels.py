"""Calling one kernel directly, the way the op tests do: the reference and cpu tables
in the NumPy namespace, attributes normalized by the op's schema."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from keel.backends.base import DeviceKind, KernelContext
from keel.backends.cpu.kernels import load as load_cpu
from keel.backends.reference.kernels import load as load_reference
from keel.ops.registry import Op
from keel.ops.schema import get_schema

REF_CTX = KernelContext(np, "reference", DeviceKind.CPU)
CPU_CTX = KernelContext(np, "cpu", DeviceKind.CPU)


def run_ref(op: Op, inputs: Sequence[Any], out: Sequence[Any] | None = None,
            **attrs: Any) -> list[np.ndarray]:
    """The reference kernel of ``op`` on ``inputs``, into ``out`` when given."""
    norm = get_schema(op).normalize_attrs(attrs)
    return list(load_reference().get(op).fn(REF_CTX, list(inputs), norm, out))


def run_cpu(op: Op, inputs: Sequence[Any], out: Sequence[Any] | None = None,
            variant: str = "default", **attrs: Any) -> list[Any]:
    """A cpu kernel variant of ``op`` on ``inputs``, into ``out`` when given."""
    norm = get_schema(op).normalize_attrs(attrs)
    return list(load_cpu().get(op, variant).fn(CPU_CTX, list(inputs), norm, out))


def run_both(op: Op, inputs: Sequence[Any], rtol: float = 1e-5, atol: float = 1e-5,
             **attrs: Any) -> list[np.ndarray]:
    """Reference outputs, after checking the cpu kernel agrees with them."""
    expected = run_ref(op, inputs, **attrs)
    assert_close(run_cpu(op, inputs, **attrs), expected, rtol, atol)
    return expected


def assert_close(actual: Sequence[np.ndarray], expected: Sequence[np.ndarray],
                 rtol: float = 1e-5, atol: float = 1e-5) -> None:
    """Same count, dtypes and shapes; floats within tolerance, others exact."""
    assert len(actual) == len(expected), (len(actual), len(expected))
    for a, e in zip(actual, expected, strict=True):
        assert a.dtype == e.dtype, (a.dtype, e.dtype)
        assert a.shape == e.shape, (a.shape, e.shape)
        if e.dtype.kind in "fc":
            np.testing.assert_allclose(a, e, rtol=rtol, atol=atol, equal_nan=True)
        else:
            np.testing.assert_array_equal(a, e)
