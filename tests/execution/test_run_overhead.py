"""What a run costs around its kernels: thread caps only where BLAS may run, outputs
handed out without copies where that is safe (and copied where it is not), the
predict fast path's signature check, feeds released after a failure, concurrent
predicts."""

from __future__ import annotations

import contextlib
import functools
import threading
import weakref
from collections.abc import Iterator, Mapping, Sequence
from contextlib import AbstractContextManager
from typing import Any

import numpy as np
import pytest
from onnx import TensorProto, helper

import keel.backends.cpu.backend as cpu_backend
from keel.backends.base import KernelContext, KernelTable, KernelVariant
from keel.backends.cpu.backend import CpuBackend
from keel.backends.registry import BackendRegistry
from keel.dtypes import DType
from keel.errors import ExecutionError
from keel.execution.model import load_model
from keel.execution.program import Program, compile_program
from keel.graph.ir import Graph, Node, Value
from keel.graph.shape_inference import infer_graph_types
from keel.ops.registry import Op
from keel.ops.schema import get_schema
from keel.ops.types import TensorType
from keel.planning.placement import place
from keel.testing.backends import FakeBackend
from keel.testing.models import make_inputs, mlp

Ins = Sequence[Any]
Out = Sequence[Any] | None
Attrs = Mapping[str, Any]
F32 = TensorType(DType.FLOAT32, (2,))


def node(name: str, op: Op, inputs: list[str], outputs: list[str]) -> Node:
    return Node(name, op, inputs, outputs, get_schema(op).normalize_attrs({}))


def _noop(ctx: KernelContext, ins: Ins, attrs: Attrs, out: Out) -> list[Any]:
    return []


def variant(op: Op, name: str = "default", **meta: Any) -> KernelVariant:
    return KernelVariant(op, name, _noop, meta=meta)


# ---- which programs take the thread cap ------------------------------------------------
@pytest.mark.parametrize(("kernels", "needed"), [
    ([], False),
    ([(variant(Op.RELU), DType.FLOAT32)], False),
    ([(variant(Op.GEMM), DType.FLOAT32)], True),
    ([(variant(Op.LAYER_NORM), DType.FLOAT32)], True),          # rows reduced by BLAS dots
    ([(variant(Op.GLOBAL_AVG_POOL), DType.FLOAT32)], True),     # a matrix-vector product
    ([(variant(Op.GEMM, "native", requires="native"), DType.FLOAT32)], False),
    # Native kernels are float32: on float64 the variant runs its NumPy path.
    ([(variant(Op.GEMM, "native", requires="native"), DType.FLOAT64)], True),
    ([(variant(Op.CONV, "native", requires="native"), None)], True),
    ([(variant(Op.RELU), DType.FLOAT32),
      (variant(Op.CONV, "native", requires="native"), DType.FLOAT32),
      (variant(Op.MATMUL), DType.FLOAT32)], True),
    # A variant's own word wins either way.
    ([(variant(Op.RELU, blas=True), DType.FLOAT32)], True),
    ([(variant(Op.GEMM, blas=False), DType.FLOAT32)], False),
])
def test_the_cpu_backend_caps_threads_only_for_kernels_that_may_call_blas(
        kernels: list[tuple[KernelVariant, DType | None]], needed: bool) -> None:
    assert CpuBackend(threads=1).needs_scope(kernels) is needed


class ScopedBackend(FakeBackend):
    """Counts how often its execution scope is entered; says whether it is needed."""

    def __init__(self, table: KernelTable, needed: bool) -> None:
        super().__init__("scoped", table=table)
        self.needed = needed
        self.entered = 0
        self.asked: list[tuple[tuple[str, str, DType | None], ...]] = []

    def _needs_scope(self, kernels: Sequence[tuple[KernelVariant, DType | None]]) -> bool:
        self.asked.append(tuple((v.op.value, v.name, dt) for v, dt in kernels))
        return self.needed

    def _execution_scope(self, op: Op | None) -> AbstractContextManager[Any]:
        return self._count()

    @contextlib.contextmanager
    def _count(self) -> Iterator[None]:
        self.entered += 1
        yield


def relu_table() -> KernelTable:
    table = KernelTable("scoped")

    @table.kernel(Op.RELU, supports_out=True)
    def _relu(ctx: KernelContext, ins: Ins, attrs: Attrs, out: Out) -> list[Any]:
        return [np.maximum(ins[0], 0, out=None if out is None else out[0])]

    return table


def compile_on(backend: FakeBackend, graph: Graph, shapes: dict[str, tuple[int, ...]]
               ) -> Program:
    reg = BackendRegistry()
    reg.register(backend.name, functools.partial(lambda b: b, backend), priority=10)
    types = infer_graph_types(graph, shapes)
    plan = place(graph, types, reg, backend=backend.name)
    return compile_program(graph, plan, types, {backend.name: backend})


def relu_chain() -> Graph:
    return Graph("chain", [node("a", Op.RELU, ["x"], ["h"]), node("b", Op.RELU, ["h"], ["y"])],
                 [Value("x", F32)], [Value("y", F32)])


@pytest.mark.parametrize("needed", [False, True])
def test_a_program_enters_its_backends_scope_once_per_run_only_when_needed(
        needed: bool) -> None:
    backend = ScopedBackend(relu_table(), needed)
    prog = compile_on(backend, relu_chain(), {"x": (2,)})
    # Asked with the same steps twice: placement records the decision in the node plans,
    # the compiled program enters the scope it describes.
    assert backend.asked == [(("relu", "default", DType.FLOAT32),) * 2] * 2
    x = np.array([-1.0, 2.0], np.float32)
    prog.run({"x": x})                                    # binds the arena
    before = backend.entered
    for _ in range(3):
        np.testing.assert_array_equal(prog.execute([x])["y"], [0.0, 2.0])
    np.testing.assert_array_equal(prog.run({"x": x})["y"], [0.0, 2.0])
    assert backend.entered - before == (4 if needed else 0)


def test_a_cpu_model_of_blas_free_ops_leaves_the_blas_pools_alone(
        monkeypatch: pytest.MonkeyPatch) -> None:
    pool = FakePool(4)
    monkeypatch.setattr(cpu_backend, "_pools", lambda: (pool,))
    proto = helper.make_model(helper.make_graph(
        [helper.make_node("Relu", ["x"], ["h"]), helper.make_node("Sigmoid", ["h"], ["y"])],
        "act", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [3])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [3])]),
        opset_imports=[helper.make_opsetid("", 17)])
    m = load_model(proto, backend="cpu", threads=1)
    x = np.array([-1.0, 0.0, 2.0], np.float32)
    m.predict({"x": x})                                   # compiles (allocating caps too)
    pool.sets.clear()
    for _ in range(3):
        y = m.predict({"x": x})["y"]
    np.testing.assert_allclose(y, 1 / (1 + np.exp(-np.maximum(x, 0))), rtol=1e-6)
    assert pool.sets == [] and pool.threads == 4


class FakePool:
    def __init__(self, threads: int) -> None:
        self.threads = threads
        self.sets: list[int] = []

    def get_num_threads(self) -> int:
        return self.threads

    def set_num_threads(self, n: int) -> None:
        self.sets.append(n)
        self.threads = n


def test_a_thread_cap_restores_pools_in_reverse_order_and_can_be_entered_again(
        monkeypatch: pytest.MonkeyPatch) -> None:
    first, second = FakePool(4), FakePool(3)
    monkeypatch.setattr(cpu_backend, "_pools", lambda: (first, second))
    cap = cpu_backend.ThreadCap(1)
    for _ in range(2):
        with cap:
            assert (first.threads, second.threads) == (1, 1)
        assert (first.threads, second.threads) == (4, 3)
    assert first.sets == [1, 4, 1, 4] and second.sets == [1, 3, 1, 3]


# ---- outputs ------------------------------------------------------------------------------
def test_outputs_that_are_feeds_or_weights_are_handed_out_as_copies() -> None:
    w = np.array([1.0, 2.0], np.float32)
    g = Graph("pass", [node("r", Op.RELU, ["x"], ["y"])], [Value("x", F32)],
              [Value("y", F32), Value("x", F32), Value("w", F32)], initializers={"w": w})
    m = load_model(g, backend="cpu", optimization_level="none")
    x = np.array([-1.0, 3.0], np.float32)
    for _ in range(2):                                    # the checked path, then the fast one
        out = m.predict({"x": x})
        np.testing.assert_array_equal(out["y"], [0.0, 3.0])
        assert not np.shares_memory(out["x"], x)
        weight = m.graph.initializers["w"]
        assert out["w"].flags.writeable and not np.shares_memory(out["w"], weight)
        np.testing.assert_array_equal(out["x"], x)
        np.testing.assert_array_equal(out["w"], w)


def test_a_kernel_returning_its_input_as_an_output_gives_the_caller_a_copy() -> None:
    table = KernelTable("scoped")

    @table.kernel(Op.IDENTITY)                            # allocates: returns its input
    def _same(ctx: KernelContext, ins: Ins, attrs: Attrs, out: Out) -> list[Any]:
        return [ins[0]]

    g = Graph("same", [node("i", Op.IDENTITY, ["x"], ["y"])], [Value("x", F32)],
              [Value("y", F32)])
    prog = compile_on(ScopedBackend(table, False), g, {"x": (2,)})
    x = np.array([1.0, 2.0], np.float32)
    for y in (prog.run({"x": x})["y"], prog.execute([x])["y"]):
        np.testing.assert_array_equal(y, x)
        assert not np.shares_memory(y, x)


def test_outputs_are_fresh_each_run_and_never_arena_bytes() -> None:
    proto = mlp(in_features=8, hidden=(16,), classes=4)
    m = load_model(proto, backend="cpu", threads=1)
    feeds = make_inputs(proto, 1, seed=3)
    first = m.predict(feeds)["probs"]
    second = m.predict(feeds)["probs"]
    _, program = _program_of(m, feeds)
    assert not np.shares_memory(first, second)
    assert not np.shares_memory(second, program.arena())
    np.testing.assert_array_equal(first, second)


def _program_of(m: Any, feeds: dict[str, np.ndarray]) -> tuple[Any, Program]:
    hit = m._fast_path(feeds)
    assert hit is not None, "the signature run last is remembered"
    return hit[0][0], hit[0][1]


# ---- the predict fast path ----------------------------------------------------------------
def test_repeated_predicts_match_feeds_by_name_whatever_the_dict_order() -> None:
    t = TensorType(DType.FLOAT32, ("n", 2))
    g = Graph("sub", [node("s", Op.SUB, ["a", "b"], ["y"])], [Value("a", t), Value("b", t)],
              [Value("y", t)])
    m = load_model(g, backend="cpu")
    a = np.array([[5.0, 7.0]], np.float32)
    b = np.array([[1.0, 2.0]], np.float32)
    for feeds in ({"a": a, "b": b}, {"b": b, "a": a}, {"a": a, "b": b}):
        np.testing.assert_array_equal(m.predict(feeds)["y"], [[4.0, 5.0]])
    np.testing.assert_array_equal(m.predict({"b": a, "a": b})["y"], [[-4.0, -5.0]])


def test_feeds_laid_out_differently_take_the_checked_path_and_agree() -> None:
    m = load_model(relu_model(), backend="cpu")
    plain = np.array([[-1.0, 2.0, -3.0, 4.0]], np.float32)
    odd = np.lib.stride_tricks.as_strided(plain, (1, 4), (4, 4))   # the row's stride unused
    assert odd.flags.c_contiguous and odd.strides != plain.strides
    wide = np.repeat(plain, 2, axis=1).reshape(1, 4, 2)[..., 0]   # (1, 4), every other item
    assert not wide.flags.c_contiguous
    want = np.maximum(plain, 0)
    for x in (plain, odd, plain, odd, wide, wide, plain):
        np.testing.assert_array_equal(m.predict({"x": x})["y"], want)


def relu_model() -> Any:
    return helper.make_model(helper.make_graph(
        [helper.make_node("Relu", ["x"], ["y"])], "relu",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", 4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["n", 4])]),
        opset_imports=[helper.make_opsetid("", 17)])


# ---- failures and threads -----------------------------------------------------------------
def test_a_failing_run_keeps_no_reference_to_its_feeds() -> None:
    table = relu_table()

    @table.kernel(Op.SIGMOID, supports_out=True)
    def _bad(ctx: KernelContext, ins: Ins, attrs: Attrs, out: Out) -> list[Any]:
        raise ValueError("refused")

    g = Graph("fail", [node("r", Op.RELU, ["x"], ["h"]), node("bad", Op.SIGMOID, ["h"], ["y"])],
              [Value("x", F32)], [Value("y", F32)])
    prog = compile_on(ScopedBackend(table, False), g, {"x": (2,)})
    for run in (lambda a: prog.run({"x": a}), lambda a: prog.execute([a])):
        x = np.ones(2, np.float32)
        ref = weakref.ref(x)
        with pytest.raises(ExecutionError, match="sigmoid on scoped failed: ValueError"):
            run(x)
        del x
        assert ref() is None


def test_predict_from_several_threads_gives_each_caller_its_own_result() -> None:
    # Layers wide enough that kernels release the GIL: without the model's lock,
    # runs interleave and share one arena (measured: hundreds of wrong results).
    proto = mlp(in_features=256, hidden=(512, 256), classes=4)
    m = load_model(proto, backend="cpu", threads=1)
    feeds = [make_inputs(proto, 1, seed=s) for s in range(4)]
    want = [m.predict(f)["probs"] for f in feeds]
    got: dict[int, list[np.ndarray]] = {i: [] for i in range(4)}

    def work(i: int) -> None:
        for _ in range(100):
            got[i].append(m.predict(feeds[i])["probs"])

    threads = [threading.Thread(target=work, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for i in range(4):
        assert len(got[i]) == 100
        for y in got[i]:
            np.testing.assert_array_equal(y, want[i])
