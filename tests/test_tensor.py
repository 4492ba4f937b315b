"""TensorDesc and seed 004's Tensor API: arithmetic, reductions, devices, dispatch reasons."""

from __future__ import annotations

import subprocess
import sys
import threading
from collections.abc import Iterator

import numpy as np
import pytest

import keel
from keel import config
from keel.backends.base import DeviceKind
from keel.backends.registry import builtin_registry
from keel.dtypes import DType
from keel.errors import BackendSelectionError, InvalidArgumentError
from keel.ops.registry import Op
from keel.tensors import Tensor, TensorDesc, explain_last_dispatch, tensor, use_registry
from tests.backends.fakes import spy_registry


@pytest.fixture(autouse=True)
def _no_env_pin(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    monkeypatch.delenv("KEEL_BACKEND", raising=False)
    config.settings.cache_clear()
    yield
    config.settings.cache_clear()


# ---- TensorDesc ---------------------------------------------------------------

def test_tensor_desc_normalizes() -> None:
    desc = TensorDesc([2, np.int64(3)], "f32")
    assert desc == TensorDesc((2, 3), DType.FLOAT32, "cpu")
    assert desc.numel == 6 and desc.nbytes == 24
    assert TensorDesc(5, "int8").shape == (5,)
    assert TensorDesc((), "bool", "GPU").device == "gpu"


@pytest.mark.parametrize(("kwargs", "match"), [
    ({"shape": (2, -3), "dtype": "float32"}, r"negative dimension -3"),
    ({"shape": (2**31, 2**31, 2**31), "dtype": "float32"}, r"\(overflow\)"),
    ({"shape": (2.0,), "dtype": "float32"}, r"shape must be a sequence of ints, got \(2.0,\)"),
    ({"shape": (2,), "dtype": "complex64"}, r"unknown dtype 'complex64'"),
    ({"shape": (2,), "dtype": "string"}, r"dtype string is not allowed"),
    ({"shape": (2,), "dtype": "float32", "device": "tpu"},
     r"device 'tpu' is not allowed; use one of cpu, gpu"),
])
def test_tensor_desc_rejects_bad_input(kwargs: dict[str, object], match: str) -> None:
    with pytest.raises(InvalidArgumentError, match=match):
        TensorDesc(**kwargs)  # type: ignore[arg-type]


# ---- making and reading tensors --------------------------------------------------

def test_tensor_holds_a_copy() -> None:
    data = np.array([1.0, 2.0, 3.0], np.float32)
    t = keel.tensor(data)
    data[0] = 99
    assert isinstance(t, Tensor)
    assert t.shape == (3,) and t.dtype is DType.FLOAT32 and t.device == "cpu"
    assert t.ndim == 1 and t.size == 3 and t.nbytes == 12 and len(t) == 3
    np.testing.assert_array_equal(t.numpy(), [1, 2, 3])
    np.testing.assert_array_equal(np.asarray(t, dtype=np.int64), [1, 2, 3])
    assert tensor([[1, 2]], dtype="int16").dtype is DType.INT16
    assert "dtype=float32, device=cpu" in repr(t)


def test_keel_tensor_is_callable_in_every_import_order() -> None:
    code = ("import keel, keel.runtime, keel.tensors; t = keel.tensor([1.0, 2.0]); "
            "import keel.tensors as m; u = m.tensor([3.0]); "
            "print(type(t).__name__, type(u).__name__, keel.tensor.__name__)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True)
    assert out.stdout.split() == ["Tensor", "Tensor", "tensor"]


def test_to_gpu_without_a_gpu_names_the_target() -> None:
    if builtin_registry().availability("gpu").available:
        t = keel.tensor([1.0]).to_device("gpu")
        assert t.device == "gpu" and t.to_device("cpu").device == "cpu"
        return
    with pytest.raises(BackendSelectionError, match=r"backend 'gpu' cannot be used: gpu: ") as e:
        keel.tensor([1.0]).to_device("gpu")
    assert e.value.target == "gpu"
    with pytest.raises(BackendSelectionError, match=r"'gpu'"):
        keel.tensor([1.0], device="gpu")


def test_to_device_validates_and_is_identity_on_the_same_device() -> None:
    t = keel.tensor([1.0])
    assert t.to_device("cpu") is t
    with pytest.raises(InvalidArgumentError, match=r"device 'npu' is not allowed"):
        t.to_device("npu")


# ---- operations --------------------------------------------------------------------

def test_arithmetic_matches_numpy() -> None:
    a_np = np.array([[1.0, -2.0], [3.0, 4.0]], np.float32)
    b_np = np.array([0.5, 2.0], np.float32)
    a, b = keel.tensor(a_np), keel.tensor(b_np)
    for got, want in [(a + b, a_np + b_np), (a - b, a_np - b_np), (a * b, a_np * b_np),
                      (a / b, a_np / b_np), (-a, -a_np), (abs(a), np.abs(a_np)),
                      (a.abs(), np.abs(a_np)), (2 * a, 2 * a_np), (1 - a, 1 - a_np),
                      (a + 0.5, a_np + 0.5), (4 / b, 4 / b_np)]:
        assert got.dtype is DType.FLOAT32
        np.testing.assert_allclose(got.numpy(), want, rtol=1e-6)


def test_matmul_operator() -> None:
    a = np.arange(6, dtype=np.float64).reshape(2, 3)
    b = np.arange(12, dtype=np.float64).reshape(3, 4)
    np.testing.assert_allclose((keel.tensor(a) @ keel.tensor(b)).numpy(), a @ b)
    mixed: Tensor = a @ keel.tensor(b)  # type: ignore[assignment]  # NumPy defers to Tensor
    np.testing.assert_allclose(mixed.numpy(), a @ b)


def test_dtype_promotion_follows_numpy() -> None:
    i = keel.tensor(np.array([1, 2, 3], np.int32))
    f = keel.tensor(np.array([0.5, 0.5, 0.5], np.float32))
    assert (i + f).dtype is DType.FLOAT64                   # int32 + float32 -> float64
    assert (i * 2).dtype is DType.INT32                     # Python scalars are weak
    assert (i / 2).dtype is DType.FLOAT64                   # true division of ints
    np.testing.assert_array_equal((i / 2).numpy(), [0.5, 1.0, 1.5])
    assert (f + np.float64(1)).dtype is DType.FLOAT64
    with pytest.raises(InvalidArgumentError, match=r"cannot combine a uint8 tensor with 300"):
        keel.tensor(np.array([1], np.uint8)) + 300


def test_comparisons_are_elementwise() -> None:
    t = keel.tensor([1.0, 2.0, 3.0])
    assert (t < 2).numpy().tolist() == [True, False, False]
    assert (t <= 2).numpy().tolist() == [True, True, False]
    assert (t > 2).numpy().tolist() == [False, False, True]
    assert (t >= 2).numpy().tolist() == [False, True, True]
    assert (t == 2).numpy().tolist() == [False, True, False]
    assert (t != 2).numpy().tolist() == [True, False, True]
    with pytest.raises(TypeError):
        hash(t)


def test_reductions() -> None:
    x = np.arange(12, dtype=np.float32).reshape(3, 4) - 5
    t = keel.tensor(x)
    assert t.sum().shape == () and t.sum().item() == x.sum()
    np.testing.assert_allclose(t.sum(axis=1).numpy(), x.sum(axis=1))
    np.testing.assert_allclose(t.sum(axis=(0, 1), keepdims=True).numpy(),
                               x.sum(axis=(0, 1), keepdims=True))
    np.testing.assert_allclose(t.mean(axis=0).numpy(), x.mean(axis=0), rtol=1e-6)
    assert t.mean().item() == pytest.approx(float(x.mean()))
    assert t.max().item() == x.max()
    np.testing.assert_array_equal(t.max(axis=1, keepdims=True).numpy(),
                                  x.max(axis=1, keepdims=True))
    ints = keel.tensor([1, 2])
    assert ints.mean().dtype is DType.FLOAT64 and ints.mean().item() == 1.5
    with pytest.raises(InvalidArgumentError, match=r"max of an empty tensor"):
        keel.tensor(np.zeros((0,))).max()


def test_shape_operations() -> None:
    x = np.arange(6, dtype=np.float32)
    t = keel.tensor(x)
    np.testing.assert_array_equal(t.reshape(2, 3).numpy(), x.reshape(2, 3))
    np.testing.assert_array_equal(t.reshape((3, -1)).numpy(), x.reshape(3, 2))
    m = t.reshape(2, 3)
    np.testing.assert_array_equal(m.transpose().numpy(), x.reshape(2, 3).T)
    np.testing.assert_array_equal(m.T.numpy(), x.reshape(2, 3).T)
    np.testing.assert_array_equal(m.reshape(1, 2, 3).transpose(2, 0, 1).numpy(),
                                  x.reshape(1, 2, 3).transpose(2, 0, 1))
    assert m.astype("int64").dtype is DType.INT64
    assert m.astype("float32") is m
    with pytest.raises(InvalidArgumentError, match=r"dimensions must be ints"):
        t.reshape(2.5)  # type: ignore[arg-type]


def test_truth_value_and_item() -> None:
    assert bool(keel.tensor([3.0]) > 1)
    with pytest.raises(InvalidArgumentError, match=r"truth value of a tensor of shape \(2,\) "
                                                   r"is ambiguous"):
        bool(keel.tensor([1.0, 2.0]))
    with pytest.raises(InvalidArgumentError, match=r"item\(\) needs a tensor of one element"):
        keel.tensor([1.0, 2.0]).item()


# ---- dispatch and its explanation ---------------------------------------------------

def test_explain_last_dispatch_says_where_and_why() -> None:
    t = keel.tensor([1.0, 2.0])
    _ = t + t
    record = explain_last_dispatch()
    assert record is not None and record.op == "add"
    assert builtin_registry().availability(record.backend).available
    assert record.reason
    assert {b for b, _ in record.rejected} | {record.backend} == {"gpu", "cpu", "reference"}
    assert str(record).startswith(f"add ran on {record.backend} (cpu): ")
    assert keel.explain_last_dispatch() == record


def test_last_dispatch_is_per_thread() -> None:
    _ = keel.tensor([1.0]) * 2
    seen: list[object] = []
    worker = threading.Thread(target=lambda: seen.append(explain_last_dispatch()))
    worker.start()
    worker.join()
    assert seen == [None]
    record = explain_last_dispatch()
    assert record is not None and record.op == "mul"


def _gpu_like_registry() -> object:
    return spy_registry(
        gpu={"device": DeviceKind.GPU, "ops": (Op.ADD,), "priority": 3},
        cpu={"ops": (Op.ADD, Op.RELU), "priority": 2},
    )


def test_data_on_the_gpu_stays_there() -> None:
    with use_registry(_gpu_like_registry()):  # type: ignore[arg-type]
        g = keel.tensor([1.0, 2.0], device="gpu")
        assert g.device == "gpu" and g.backend == "gpu"
        s = g + g
        record = explain_last_dispatch()
    assert s.device == "gpu"
    assert record is not None and record.backend == "gpu"
    assert "already live on the GPU" in record.reason
    np.testing.assert_array_equal(s.numpy(), [2, 4])


def test_small_cpu_work_stays_on_the_cpu_even_with_a_gpu() -> None:
    with use_registry(_gpu_like_registry()):  # type: ignore[arg-type]
        c = keel.tensor([1.0, 2.0])
        _ = c + c
        record = explain_last_dispatch()
    assert record is not None and record.backend == "cpu"
    assert "under 1 MB" in dict(record.rejected)["gpu"]


def test_environment_pin_is_authoritative(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KEEL_BACKEND", "reference")
    config.settings.cache_clear()
    _ = keel.tensor([1.0]) + 1.0
    record = explain_last_dispatch()
    assert record is not None and record.backend == "reference"
    assert record.reason == "pinned by KEEL_BACKEND"


@pytest.mark.parametrize("data", [None, {}, [10**400], "abc", [[1], [1, 2]]])
def test_tensor_of_non_numeric_data_says_so(data: object) -> None:
    with pytest.raises(InvalidArgumentError, match="cannot make a tensor from"):
        tensor(data)
