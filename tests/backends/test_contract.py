"""The backend contract of keel.backends.base, on fake backends and the real ones."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from keel.backends.base import (
    Availability,
    Backend,
    Capabilities,
    DeviceKind,
    KernelContext,
    KernelTable,
)
from keel.backends.cpu.backend import CpuBackend
from keel.backends.reference.backend import ReferenceBackend
from keel.dtypes import DType
from keel.errors import (
    BackendSelectionError,
    ExecutionError,
    InvalidArgumentError,
    UnsupportedOperationError,
)
from keel.ops.registry import Op
from tests.backends.fakes import make_backend, spy_registry


def _registry() -> Any:
    return spy_registry(
        gpu={"device": DeviceKind.GPU, "ops": (Op.ADD, Op.RELU), "available": False,
             "reason": "no device", "priority": 3},
        fast={"ops": (Op.ADD,), "priority": 2},
        slow={"ops": (Op.ADD, Op.RELU, Op.MUL), "priority": 1},
    )


def test_unsupported_op_lists_the_backends_that_have_it() -> None:
    reg = _registry()
    fast = reg.get("fast")
    with pytest.raises(UnsupportedOperationError,
                       match=r"'relu' is not supported by backend 'fast'; supported on: slow$"
                       ) as info:
        fast.run(Op.RELU, [np.ones(3, np.float32)])
    assert info.value.supported_on == ("slow",)
    assert info.value.backend == "fast"


def test_unsupported_op_outside_a_registry_lists_nothing() -> None:
    lone = make_backend("lone", ops=(Op.ADD,))()
    with pytest.raises(UnsupportedOperationError, match=r"supported on: no backend"):
        lone.run("relu", [np.ones(3)])


def test_unknown_op_name_is_an_unsupported_operation() -> None:
    with pytest.raises(UnsupportedOperationError, match=r"'frobnicate'.*unknown op; known ops"):
        _registry().get("slow").run("frobnicate", [np.ones(3)])


def test_unavailable_backend_refuses_to_run_or_allocate() -> None:
    gpu = _registry().instance("gpu")
    with pytest.raises(BackendSelectionError, match=r"'gpu' cannot be used: no device"):
        gpu.run(Op.ADD, [np.ones(2), np.ones(2)])
    with pytest.raises(BackendSelectionError, match=r"'gpu'"):
        gpu.allocate((2,), "float32")
    with pytest.raises(BackendSelectionError, match=r"'gpu'"):
        gpu.to_device(np.ones(2))
    assert gpu.allocations == 0


def test_run_returns_results_and_writes_outputs_on_success() -> None:
    slow = _registry().get("slow")
    a, b = np.arange(3, dtype=np.float32), np.ones(3, np.float32)
    (res,) = slow.run(Op.ADD, [a, b])
    np.testing.assert_array_equal(res, [1, 2, 3])
    out = slow.allocate((3,), "float32")
    assert slow.run(Op.ADD, [a, b], [out])[0] is out
    np.testing.assert_array_equal(out, [1, 2, 3])


def test_failing_kernel_leaves_outputs_untouched() -> None:
    slow = _registry().get("slow")
    out = np.full(3, 7.0, np.float32)
    with pytest.raises(ExecutionError, match=r"node 'mul': RuntimeError: kernel exploded"):
        slow.run(Op.MUL, [np.ones(3, np.float32), np.ones(3, np.float32)], [out])
    np.testing.assert_array_equal(out, [7, 7, 7])   # the kernel only saw a scratch buffer


def test_mismatched_output_is_rejected_before_any_write() -> None:
    slow = _registry().get("slow")
    good = np.full(3, 7.0, np.float32)
    wrong_shape = np.full(4, 7.0, np.float32)
    with pytest.raises(InvalidArgumentError, match=r"output 0 is float32\[4\], the result is "
                                                   r"float32\[3\]"):
        slow.run(Op.ADD, [np.ones(3, np.float32), np.ones(3, np.float32)], [wrong_shape])
    wrong_dtype = np.full(3, 7.0, np.float64)
    with pytest.raises(InvalidArgumentError, match=r"output 0 is float64\[3\]"):
        slow.run(Op.ADD, [np.ones(3, np.float32), np.ones(3, np.float32)], [wrong_dtype])
    np.testing.assert_array_equal(good, [7, 7, 7])
    np.testing.assert_array_equal(wrong_shape, [7, 7, 7, 7])


def test_arity_and_attributes_are_checked_against_the_schema() -> None:
    slow = _registry().get("slow")
    with pytest.raises(InvalidArgumentError, match=r"add takes 2\.\.2 inputs, got 1"):
        slow.run(Op.ADD, [np.ones(3)])
    with pytest.raises(InvalidArgumentError, match=r"unknown attribute 'alpha' for add"):
        slow.run(Op.ADD, [np.ones(3), np.ones(3)], attrs={"alpha": 2})


def test_foreign_arrays_are_rejected() -> None:
    slow = _registry().get("slow")
    with pytest.raises(InvalidArgumentError,
                       match=r"input 1 is a builtins.list; backend 'slow' takes its own arrays"):
        slow.run(Op.ADD, [np.ones(3), [1, 2, 3]])


def test_kernel_dtype_limits_are_unsupported_operations() -> None:
    table = KernelTable("picky")

    @table.kernel(Op.RELU, dtypes=["float32"])
    def relu(ctx: KernelContext, inputs: Any, attrs: Any, out: Any) -> list[Any]:
        return [np.maximum(inputs[0], 0)]

    class Picky(Backend):
        name = "picky"
        device = DeviceKind.CPU

        def _check_available(self) -> Availability:
            return Availability(True, "here")

        def _kernels(self) -> KernelTable:
            return table

        @property
        def xp(self) -> Any:
            return np

    picky = Picky()
    assert picky.supports(Op.RELU, "float32") and not picky.supports(Op.RELU, DType.FLOAT64)
    with pytest.raises(UnsupportedOperationError,
                       match=r"'relu' is not supported by backend 'picky'.*dtype float64; "
                             r"this backend takes float32"):
        picky.run(Op.RELU, [np.ones(2)])


def test_availability_check_that_raises_is_recorded() -> None:
    class Flaky(make_backend("flaky")):  # type: ignore[misc]
        def _check_available(self) -> Availability:
            raise RuntimeError("probe crashed")

    flaky = Flaky()
    assert not flaky.is_available()
    assert flaky.availability().reason == "availability check failed: RuntimeError: probe crashed"


def test_allocate_validates_shape_and_dtype() -> None:
    cpu = CpuBackend()
    with pytest.raises(InvalidArgumentError, match=r"negative dimension -1"):
        cpu.allocate((2, -1), "float32")
    with pytest.raises(InvalidArgumentError, match=r"cannot hold string"):
        cpu.allocate((2,), "string")
    with pytest.raises(InvalidArgumentError, match=r"more than .* elements \(overflow\)"):
        cpu.allocate((2**40, 2**40), "float32")
    with pytest.raises(InvalidArgumentError, match=r"must hold integers only"):
        cpu.allocate((2.5,), "float32")  # type: ignore[arg-type]
    x = cpu.allocate((np.int64(2), 3), "int8")
    assert x.shape == (2, 3) and x.dtype == np.int8 and not x.any()


def test_write_and_read_copy() -> None:
    ref = ReferenceBackend()
    x = ref.allocate((2, 2), "float32")
    ref.write(x, [1, 2, 3, 4])                      # same element count is enough
    host = ref.read(x)
    np.testing.assert_array_equal(host, [[1, 2], [3, 4]])
    host[0, 0] = 99
    assert x[0, 0] == 1                              # read gives a copy
    with pytest.raises(InvalidArgumentError, match=r"cannot write data of shape \(3,\) into "
                                                   r"a tensor of shape \(2, 2\)"):
        ref.write(x, [1, 2, 3])
    ints = ref.allocate((2,), "int32")
    with pytest.raises(InvalidArgumentError, match=r"cannot write float64 data into a tensor of "
                                                   r"dtype int32 without changing its kind"):
        ref.write(ints, [1.5, 2.0])


def test_to_device_copies() -> None:
    host = np.arange(4.0)
    arr = CpuBackend().to_device(host)
    host[0] = 42
    assert arr[0] == 0
    assert CpuBackend().to_device(None) is None


def test_capabilities_are_plain_data() -> None:
    caps = ReferenceBackend().capabilities()
    assert isinstance(caps, Capabilities)
    assert caps.available and caps.device is DeviceKind.CPU
    data = caps.to_dict()
    assert data["device"] == "cpu" and data["name"] == "reference"
    assert isinstance(data["ops"], list) and "float32" in data["dtypes"]
    assert Availability(True, "x").to_dict() == {"available": True, "reason": "x"}


def test_cpu_backend_threads() -> None:
    assert CpuBackend(threads=1).threads == 1
    assert CpuBackend().threads >= 1
    assert CpuBackend().context().threads == CpuBackend().threads
    with pytest.raises(InvalidArgumentError, match=r"threads must be a positive int or None, "
                                                   r"got 0"):
        CpuBackend(threads=0)


def test_cpu_backend_caps_blas_threads_only_while_running() -> None:
    from threadpoolctl import threadpool_info

    before = [lib["num_threads"] for lib in threadpool_info()]
    cpu = CpuBackend(threads=1)
    with cpu.execution_scope():
        inside = [lib["num_threads"] for lib in threadpool_info()]
    with cpu.execution_scope(Op.MATMUL):
        for_blas = [lib["num_threads"] for lib in threadpool_info()]
    with cpu.execution_scope(Op.ADD):        # elementwise kernels use no thread pool
        for_ufunc = [lib["num_threads"] for lib in threadpool_info()]
    after = [lib["num_threads"] for lib in threadpool_info()]
    assert all(n == 1 for n in inside) and all(n == 1 for n in for_blas)
    assert after == before == for_ufunc


def test_a_thread_pool_imported_after_the_first_cap_is_capped(
        tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """A module imported after keel first capped the pools, loading a library with an
    OpenMP pool as it imports (as torch loads libgomp): the next run caps that pool too
    and restores it after. The library is a copy of the system's libgomp under a new
    name, so it is loaded anew, whatever this process loaded before."""
    import ctypes.util
    import importlib
    import shutil
    from pathlib import Path

    from threadpoolctl import threadpool_info

    name = ctypes.util.find_library("gomp")
    places = ("/lib/x86_64-linux-gnu", "/usr/lib/x86_64-linux-gnu", "/lib64", "/usr/lib64",
              "/usr/lib")
    system = next((Path(p, name) for p in places if name and Path(p, name).exists()), None)
    if system is None:
        pytest.skip("no system libgomp to load")
    copy = tmp_path / "libgomp-keel-test.so.1"
    shutil.copy(system, copy)
    cpu = CpuBackend(threads=1)
    with cpu.execution_scope():
        pass                                    # keel's first cap in this test, at least
    (tmp_path / "keel_test_loads_gomp.py").write_text(
        f"import ctypes\nLIB = ctypes.CDLL({str(copy)!r}, ctypes.RTLD_GLOBAL)\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    importlib.import_module("keel_test_loads_gomp")

    def threads() -> int:
        (n,) = [lib["num_threads"] for lib in threadpool_info()
                if lib["filepath"] == str(copy)]
        return int(n)

    before = threads()
    cap = CpuBackend(threads=before + 1)
    with cap.execution_scope():
        inside = threads()
    assert (inside, threads()) == (before + 1, before)


def test_keel_threads_setting_is_the_cpu_default(monkeypatch: pytest.MonkeyPatch) -> None:
    from keel import config

    monkeypatch.setenv("KEEL_THREADS", "3")
    config.settings.cache_clear()
    try:
        assert CpuBackend().threads == 3
    finally:
        monkeypatch.delenv("KEEL_THREADS")
        config.settings.cache_clear()


def test_plan_wide_decisions_are_final_methods_over_hooks() -> None:
    """plan_notes, plan_branches and staging are the contract's final methods; a backend
    says its planner's decisions through _plan_notes, _plan_branches and _staging."""
    for name in ("plan_notes", "plan_branches", "staging"):
        assert getattr(getattr(Backend, name), "__final__", False), name
        assert name not in vars(CpuBackend), name
    plain = make_backend("plain", ops=(Op.ADD,))()
    assert plain.plan_notes() == () and plain.staging() == (0, 0)
    assert plain.plan_branches([[(1e9, 1)], [(1e9, 1)]]) == (
        1, "in order: the plain backend runs one node at a time")
    cpu = CpuBackend(threads=2)
    assert cpu.plan_notes()[0] == f"cpu backend, {cpu.threads_reason}"
    lanes, why = cpu.plan_branches([[(1e9, 1)], [(1e9, 1)]])
    assert lanes == 2 and why
