"""Seed 001's op-level runtime interface, and the 19 ops of its GPU profile."""

from __future__ import annotations

import functools
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

import keel
from keel import config
from keel.backends.base import Backend, DeviceKind
from keel.backends.registry import BackendRegistry, builtin_registry
from keel.errors import (
    BackendSelectionError,
    ExecutionError,
    InvalidArgumentError,
    UnsupportedOperationError,
)
from keel.ops.registry import Op, OpGroup
from keel.runtime import Runtime, RuntimeTensor
from keel.tensors import TensorDesc
from tests.backends.fakes import SpyBackend, spy_registry

BACKENDS = [pytest.param(n, id=n, marks=[pytest.mark.gpu] if n == "gpu" else [])
            for n in ("reference", "cpu", "gpu")]


@pytest.fixture(autouse=True)
def _no_env_pin(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    monkeypatch.delenv("KEEL_BACKEND", raising=False)
    config.settings.cache_clear()
    yield
    config.settings.cache_clear()


def _runtime(name: str) -> Runtime:
    avail = builtin_registry().availability(name)
    if not avail.available:
        pytest.skip(f"backend {name!r} is not available here: {avail.reason}")
    return Runtime(backend=name, registry=builtin_registry())


def _spy(reg: BackendRegistry, name: str) -> SpyBackend:
    backend = reg.instance(name)
    assert isinstance(backend, SpyBackend)
    return backend


def _device(name: str) -> str:
    return "gpu" if name == "gpu" else "cpu"


def _put(rt: Runtime, data: Any, dtype: str = "float32") -> RuntimeTensor:
    host = np.asarray(data, dtype=dtype)
    t = rt.allocate(TensorDesc(host.shape, dtype, _device(rt.backend)))
    rt.write(t, host)
    return t


X = [[1, 2, 3], [4, 5, 6]]

# op, inputs (data, dtype), attrs, expected (exact) — hand-computed from seed 001's semantics.
SEED_OPS: list[tuple[str, list[tuple[Any, str]], dict[str, Any], Any]] = [
    ("sum_all", [(X, "float32")], {}, np.float32(21)),
    ("mean_all", [(X, "float32")], {}, np.float32(3.5)),
    ("sum", [(X, "float32")], {"axes": (1,), "keepdims": False}, [6, 15]),
    ("mean", [(X, "float32")], {"axes": (0,), "keepdims": False}, [2.5, 3.5, 4.5]),
    ("add", [(X, "float32"), ([10, 20, 30], "float32")], {}, [[11, 22, 33], [14, 25, 36]]),
    ("mul", [(X, "float32"), ([[2], [3]], "float32")], {}, [[2, 4, 6], [12, 15, 18]]),
    ("relu", [([-1, 0, 2.5, -3], "float32")], {}, [0, 0, 2.5, 0]),
    ("matmul", [(X, "float32"), ([[1, 0], [0, 1], [1, 1]], "float32")], {}, [[4, 5], [10, 11]]),
    ("dot", [([1, 2, 3], "float32"), ([4, 5, 6], "float32")], {}, np.float32(32)),
    ("conv2d", [(np.arange(1, 10).reshape(1, 1, 3, 3), "float32"),
                (np.ones((1, 1, 2, 2)), "float32")], {}, [[[[12, 16], [24, 28]]]]),
    ("reshape", [(X, "float32")], {"shape": (3, 2)}, [[1, 2], [3, 4], [5, 6]]),
    ("expand_dims", [(X, "float32")], {"axis": 0}, [X]),
    ("squeeze", [([[[1, 2, 3]], [[4, 5, 6]]], "float32")], {"axes": (1,)}, X),
    ("transpose", [(X, "float32")], {"perm": (1, 0)}, [[1, 4], [2, 5], [3, 6]]),
    ("index", [(X, "float32")], {"index": -1, "axis": 1}, [3, 6]),
    ("slice", [(X, "float32")], {"starts": (0, 1), "ends": (2, 3), "axes": (0, 1)},
     [[2, 3], [5, 6]]),
    ("gather", [(X, "float32"), ([1, 0, 1], "int64")], {"axis": 0},
     [[4, 5, 6], [1, 2, 3], [4, 5, 6]]),
    ("copy", [(X, "float32")], {}, X),
    ("fill", [([42, 0, 0, 0], "float32")], {}, [42] * 8),
]


def test_seed_op_table_covers_the_gpu_profile() -> None:
    assert {Op(name) for name, *_ in SEED_OPS} == OpGroup.SEED_GPU_PROFILE


@pytest.mark.parametrize(("op", "inputs", "attrs", "expected"),
                         [pytest.param(*case, id=case[0]) for case in SEED_OPS])
@pytest.mark.parametrize("backend", BACKENDS)
def test_seed_001_op(backend: str, op: str, inputs: list[tuple[Any, str]],
                     attrs: dict[str, Any], expected: Any) -> None:
    rt = _runtime(backend)
    ins = [_put(rt, data, dtype) for data, dtype in inputs]
    want = np.asarray(expected, dtype=np.float32)
    out = rt.allocate(TensorDesc(want.shape, "float32", _device(backend)))
    assert rt.run_op(op, inputs=ins, outputs=[out], **attrs) == [out]
    rt.synchronize()
    got = rt.read(out)
    assert got.shape == want.shape and got.dtype == want.dtype
    np.testing.assert_array_equal(got, want)
    # the same op again gives bitwise the same result (seed 001 determinism)
    again = rt.allocate(out.desc)
    rt.run_op(op, inputs=ins, outputs=[again], **attrs)
    assert rt.read(again).tobytes() == got.tobytes()


@pytest.mark.parametrize("backend", BACKENDS)
def test_fill_follows_the_seed_example(backend: str) -> None:
    rt = _runtime(backend)
    value = rt.allocate(TensorDesc((4,), "float32", _device(backend)))
    rt.write(value, [42.0, 0.0, 0.0, 0.0])          # fill value in the first element
    output = rt.allocate(TensorDesc((8,), "float32", _device(backend)))
    rt.run_op("fill", inputs=[value], outputs=[output])
    np.testing.assert_array_equal(rt.read(output), [42.0] * 8)


@pytest.mark.parametrize("backend", BACKENDS)
def test_copy_needs_an_output_of_exactly_the_input_shape(backend: str) -> None:
    rt = _runtime(backend)
    src = _put(rt, X)
    flat = rt.allocate(TensorDesc((6,), "float32", _device(backend)))
    with pytest.raises(InvalidArgumentError, match=r"copy"):
        rt.run_op("copy", inputs=[src], outputs=[flat])
    np.testing.assert_array_equal(rt.read(flat), np.zeros(6))


# ---- backend selection errors (seed 001: stable surface, no side effects) --------

def test_pinned_unavailable_gpu_raises_before_anything_is_allocated() -> None:
    reg = spy_registry(gpu={"device": DeviceKind.GPU, "available": False,
                            "reason": "no CUDA device", "priority": 2},
                       cpu={"priority": 1})
    with pytest.raises(BackendSelectionError, match=r"^\[BACKEND_SELECTION\] backend 'gpu' "
                                                    r"cannot be used: no CUDA device$") as info:
        Runtime(backend="gpu", registry=reg)
    assert info.value.target == "gpu"
    assert _spy(reg, "gpu").allocations == 0
    assert _spy(reg, "cpu").allocations == 0


def test_runtime_gpu_on_this_machine(monkeypatch: pytest.MonkeyPatch) -> None:
    if builtin_registry().availability("gpu").available:
        rt = Runtime(backend="gpu", registry=builtin_registry())
        t = rt.allocate(TensorDesc((4,), "float32", "gpu"))
        assert t.device == "gpu" and rt.backend == "gpu"
        return
    calls: list[object] = []
    real_allocate = Backend.allocate

    def counting(self: Backend, *args: Any, **kwargs: Any) -> Any:
        calls.append(self)
        return real_allocate(self, *args, **kwargs)

    monkeypatch.setattr(Backend, "allocate", counting)
    with pytest.raises(BackendSelectionError, match=r"backend 'gpu' cannot be used") as info:
        keel.Runtime(backend="gpu")
    assert info.value.target == "gpu"
    assert calls == []


def test_keel_backend_environment_pin_is_checked_at_construction(
        monkeypatch: pytest.MonkeyPatch) -> None:
    reg = spy_registry(gpu={"device": DeviceKind.GPU, "available": False, "priority": 2},
                       cpu={"priority": 1})
    monkeypatch.setenv("KEEL_BACKEND", "gpu")
    config.settings.cache_clear()
    with pytest.raises(BackendSelectionError, match=r"'gpu'"):
        Runtime(registry=reg)
    assert Runtime(backend="cpu", registry=reg).backend == "cpu"   # the argument wins


def test_unknown_backend_name_is_a_selection_error() -> None:
    with pytest.raises(BackendSelectionError, match=r"'tpu'.*registered: gpu, cpu, reference"):
        Runtime(backend="tpu", registry=builtin_registry())
    with pytest.raises(InvalidArgumentError, match=r"backend must be a name"):
        Runtime(backend=3)  # type: ignore[arg-type]


def test_auto_runtime_cannot_place_a_gpu_tensor_without_a_gpu() -> None:
    reg = spy_registry(gpu={"device": DeviceKind.GPU, "available": False,
                            "reason": "no CUDA device", "priority": 2},
                       cpu={"priority": 1})
    rt = Runtime(registry=reg)
    with pytest.raises(BackendSelectionError, match=r"backend 'gpu' cannot be used: gpu: no "
                                                    r"CUDA device"):
        rt.allocate(TensorDesc((4,), "float32", "gpu"))
    assert _spy(reg, "cpu").allocations == 0


def test_pinned_runtime_rejects_a_descriptor_for_another_device() -> None:
    rt = Runtime(backend="cpu", registry=builtin_registry())
    with pytest.raises(InvalidArgumentError, match=r"TensorDesc device 'gpu' does not match "
                                                   r"backend 'cpu'"):
        rt.allocate(TensorDesc((4,), "float32", "gpu"))


# ---- running ops ------------------------------------------------------------------

def test_failing_kernel_leaves_outputs_untouched() -> None:
    rt = Runtime(backend="cpu", registry=builtin_registry())
    a = _put(rt, [1, 2, 3])
    b = _put(rt, [1, 2, 3, 4])
    out = _put(rt, [7, 7, 7, 7])
    with pytest.raises((ExecutionError, InvalidArgumentError)):
        rt.run_op("add", inputs=[a, b], outputs=[out])        # (3,) + (4,) cannot broadcast
    np.testing.assert_array_equal(rt.read(out), [7, 7, 7, 7])


def test_failing_kernel_across_backends_leaves_outputs_untouched() -> None:
    reg = spy_registry(fast={"ops": (Op.ADD,), "priority": 2},
                       slow={"ops": (Op.ADD, Op.MUL), "priority": 1})
    rt = Runtime(registry=reg)
    a = _put(rt, [1, 2])
    out = _put(rt, [7, 7])
    assert out.backend.name == "fast"
    with pytest.raises(ExecutionError, match=r"node 'mul': RuntimeError: kernel exploded"):
        rt.run_op("mul", inputs=[a, a], outputs=[out])       # runs on slow, which fails
    np.testing.assert_array_equal(rt.read(out), [7, 7])


def test_op_runs_where_it_is_supported_and_outputs_come_back() -> None:
    reg = spy_registry(fast={"ops": (Op.ADD,), "priority": 2},
                       slow={"ops": (Op.ADD, Op.RELU), "priority": 1})
    rt = Runtime(registry=reg)
    x = _put(rt, [-1, 2])
    out = _put(rt, [0, 0])
    rt.run_op("relu", inputs=[x], outputs=[out])
    np.testing.assert_array_equal(rt.read(out), [0, 2])
    assert rt.last_selection is not None and rt.last_selection.backend == "slow"
    assert ("fast", "has no kernel for relu") in rt.last_selection.rejected


def test_run_op_without_outputs_returns_new_tensors_owning_their_memory() -> None:
    rt = Runtime(backend="cpu", registry=builtin_registry())
    x = _put(rt, X)
    (y,) = rt.run_op("reshape", inputs=[x], shape=(3, 2))
    assert isinstance(y, RuntimeTensor) and y.shape == (3, 2) and y.dtype.value == "float32"
    rt.write(x, np.zeros((2, 3)))
    np.testing.assert_array_equal(rt.read(y), [[1, 2], [3, 4], [5, 6]])


def test_unsupported_and_unknown_ops_are_typed_errors() -> None:
    reg = spy_registry(cpu={"ops": (Op.ADD,)})
    rt = Runtime(backend="cpu", registry=reg)
    x = _put(rt, [1.0])
    with pytest.raises(UnsupportedOperationError, match=r"'relu' is not supported by backend "
                                                        r"'cpu'"):
        rt.run_op("relu", inputs=[x])
    with pytest.raises(UnsupportedOperationError, match=r"'warp' is not supported"):
        rt.run_op("warp", inputs=[x])


def test_tensors_are_checked() -> None:
    rt = Runtime(backend="cpu", registry=builtin_registry())
    other = Runtime(backend="cpu", registry=builtin_registry())
    x = _put(rt, [1.0, 2.0])
    with pytest.raises(InvalidArgumentError, match=r"cannot use a ndarray; pass a tensor"):
        rt.run_op("relu", inputs=[np.ones(2)])  # type: ignore[list-item]
    with pytest.raises(InvalidArgumentError, match=r"cannot read a tensor of another Runtime"):
        other.read(x)
    with pytest.raises(InvalidArgumentError, match=r"allocate takes a TensorDesc, got tuple"):
        rt.allocate(((2,), "float32"))  # type: ignore[arg-type]


def test_free_releases_and_use_after_free_raises() -> None:
    rt = Runtime(backend="cpu", registry=builtin_registry())
    x = _put(rt, [1.0, 2.0])
    rt.free(x)
    assert x.freed and "freed" in repr(x)
    with pytest.raises(InvalidArgumentError, match=r"was freed; allocate a new one"):
        rt.read(x)
    with pytest.raises(InvalidArgumentError, match=r"was freed"):
        rt.free(x)


def test_synchronize_waits_on_every_backend_used() -> None:
    reg = spy_registry(fast={"ops": (Op.ADD,), "priority": 2},
                       slow={"ops": (Op.ADD, Op.RELU), "priority": 1})
    synced: list[str] = []
    for name in ("fast", "slow"):
        backend = reg.instance(name)
        backend._synchronize = functools.partial(synced.append, name)  # type: ignore[method-assign]
    rt = Runtime(registry=reg)
    rt.run_op("relu", inputs=[_put(rt, [1.0])])
    rt.synchronize()
    assert sorted(synced) == ["fast", "slow"]


@pytest.mark.parametrize(("inputs", "outputs", "message"), [
    (None, None, "run_op inputs must be a list of tensors, got NoneType"),
    ((), 5, "run_op outputs must be a list of tensors, got int"),
])
def test_run_op_rejects_non_sequence_tensors(inputs: Any, outputs: Any, message: str) -> None:
    rt = Runtime(backend="cpu")
    with pytest.raises(InvalidArgumentError, match=message):
        rt.run_op("add", inputs=inputs, outputs=outputs)


# ---- seed 001's shape ops take their target from the output --------------

def _empty(rt: Runtime, shape: tuple[int, ...]) -> RuntimeTensor:
    return rt.allocate(TensorDesc(shape, "float32", _device(rt.backend)))


@pytest.mark.parametrize("name", BACKENDS)
@pytest.mark.parametrize(("op", "src", "dst"), [
    ("reshape", (35,), (7, 5)),
    ("reshape", (5, 7), (7, 5)),
    ("reshape", (2, 3, 4), (4, 6)),
    ("expand_dims", (7, 5), (1, 7, 5)),
    ("expand_dims", (7, 5), (7, 1, 5, 1)),
    ("expand_dims", (1, 5), (1, 1, 5)),
    ("squeeze", (1, 7, 1, 5), (7, 5)),
    ("squeeze", (1, 7, 1, 5), (7, 1, 5)),    # not every size-1 dim: the output decides
    ("squeeze", (1, 1), (1,)),
])
def test_shape_op_with_one_input_takes_the_output_shape(
        name: str, op: str, src: tuple[int, ...], dst: tuple[int, ...]) -> None:
    rt = _runtime(name)
    data = np.arange(int(np.prod(src)), dtype=np.float32).reshape(src)
    out = _empty(rt, dst)
    (result,) = rt.run_op(op, inputs=[_put(rt, data)], outputs=[out])
    assert result is out
    np.testing.assert_array_equal(rt.read(out), data.reshape(dst))


@pytest.mark.parametrize("name", BACKENDS)
def test_shape_op_given_target_wins(name: str) -> None:
    rt = _runtime(name)
    data = np.arange(6, dtype=np.float32).reshape(1, 6)
    x = _put(rt, data)
    (squeezed,) = rt.run_op("squeeze", inputs=[x], axes=(0,))
    np.testing.assert_array_equal(rt.read(squeezed), data[0])
    with pytest.raises(InvalidArgumentError):
        # the given shape disagrees with the output's: the shape is what the op runs
        rt.run_op("reshape", inputs=[x], outputs=[_empty(rt, (6,))], shape=(2, 3))


@pytest.mark.parametrize("name", BACKENDS)
def test_shape_op_wrong_element_count(name: str) -> None:
    rt = _runtime(name)
    out = _empty(rt, (7, 5))
    before = rt.read(out)
    with pytest.raises(InvalidArgumentError,
                       match=r"reshape: the input \(6,\) has 6 elements but the output "
                             r"\(7, 5\) holds 35"):
        rt.run_op("reshape", inputs=[_put(rt, np.ones(6, np.float32))], outputs=[out])
    np.testing.assert_array_equal(rt.read(out), before)


@pytest.mark.parametrize("name", BACKENDS)
@pytest.mark.parametrize(("op", "src", "dst", "verb"), [
    ("expand_dims", (7, 5), (5, 7, 1), "inserted"),
    ("expand_dims", (7, 5), (7, 6), "inserted"),
    ("squeeze", (1, 7, 5), (5, 7), "removed"),
    ("squeeze", (7, 5), (7, 5, 1), "removed"),
])
def test_shape_op_output_no_axes_give(name: str, op: str, src: tuple[int, ...],
                                      dst: tuple[int, ...], verb: str) -> None:
    rt = _runtime(name)
    x = _put(rt, np.zeros(src, np.float32))
    with pytest.raises(InvalidArgumentError, match=f"{op}: the output shape .* size-1 dims "
                                                   f"{verb}; give axes"):
        rt.run_op(op, inputs=[x], outputs=[_empty(rt, dst)])
