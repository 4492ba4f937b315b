"""NaN in a max-pool window: the reference (the spec) and the cpu kernels agree it wins."""

from __future__ import annotations

import numpy as np
import pytest

from keel.backends.base import DeviceKind, KernelContext
from keel.backends.cpu.kernels import load as load_cpu
from keel.backends.reference.kernels import load as load_reference
from keel.ops.registry import Op
from keel.ops.schema import get_schema


@pytest.mark.parametrize("op", [Op.MAX_POOL, Op.GLOBAL_MAX_POOL])
def test_nan_propagates_through_max_pooling(op: Op) -> None:
    x = np.arange(2 * 3 * 6 * 6, dtype=np.float32).reshape(2, 3, 6, 6)
    x[0, 1, 2, 3] = np.nan
    x[1, 2, 0, 0] = -np.inf
    attrs = get_schema(op).normalize_attrs(
        {"kernel_shape": (2, 2), "strides": (2, 2)} if op is Op.MAX_POOL else {})
    results = []
    for name, table in (("reference", load_reference()), ("cpu", load_cpu())):
        ctx = KernelContext(np, name, DeviceKind.CPU, threads=1)
        results.append(table.get(op).fn(ctx, [x], attrs, None)[0])
    ref, cpu = results
    np.testing.assert_array_equal(ref, cpu)          # NaN positions included
    if op is Op.MAX_POOL:
        assert np.isnan(ref[0, 1, 1, 1]) and np.isnan(ref).sum() == 1
    else:
        assert np.isnan(ref[0, 1, 0, 0]) and np.isnan(ref).sum() == 1


def test_max_pool_index_of_a_nan_window_is_the_first_nan() -> None:
    x = np.zeros((1, 1, 2, 2), dtype=np.float32)
    x[0, 0, 1, 0] = np.nan
    x[0, 0, 1, 1] = np.nan
    attrs = get_schema(Op.MAX_POOL).normalize_attrs({"kernel_shape": (2, 2)})
    ctx = KernelContext(np, "reference", DeviceKind.CPU)
    y, idx = load_reference().get(Op.MAX_POOL).fn(ctx, [x], attrs, None)
    assert np.isnan(y[0, 0, 0, 0]) and int(idx[0, 0, 0, 0]) == 2
