"""The run loop's fast paths: prepacked constants, precompiled steps, cheap predict, thread caps."""

from __future__ import annotations

import functools
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import onnx
import pytest
from onnx import helper, numpy_helper

import keel.backends.cpu.backend as cpu_backend
from keel.backends.base import KernelContext, KernelTable
from keel.backends.registry import BackendRegistry
from keel.dtypes import DType
from keel.errors import ExecutionError, InvalidArgumentError
from keel.execution.model import load_model
from keel.execution.program import ArenaPool, Program, compile_program
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


def node(name: str, op: Op, inputs: list[str], outputs: list[str]) -> Node:
    return Node(name, op, inputs, outputs, get_schema(op).normalize_attrs({}))


def compile_with(table: KernelTable, graph: Graph, shapes: dict[str, tuple[int, ...]],
                 pool: ArenaPool | None = None) -> Program:
    reg = BackendRegistry()
    backend = FakeBackend("fast", table=table)
    reg.register("fast", functools.partial(lambda b: b, backend), priority=10)
    types = infer_graph_types(graph, shapes)
    plan = place(graph, types, reg, backend="fast")
    return compile_program(graph, plan, types, {"fast": backend}, pool)


def matmul_graph() -> Graph:
    """y = relu(x @ w): a constant weight the matmul may prepack."""
    w = np.arange(12, dtype=np.float32).reshape(4, 3) / 10
    w.setflags(write=False)
    return Graph("mm", [node("mm", Op.MATMUL, ["x", "w"], ["h"]),
                        node("act", Op.RELU, ["h"], ["y"])],
                 [Value("x", TensorType(DType.FLOAT32, ("batch", 4)))],
                 [Value("y", TensorType(DType.FLOAT32, ("batch", 3)))],
                 initializers={"w": w})


def prepacking_table(seen: list[Any], calls: list[Any]) -> KernelTable:
    table = KernelTable("fast")

    def pack(ctx: KernelContext, consts: Ins, attrs: Attrs) -> Any:
        calls.append([c is not None for c in consts])
        return np.ascontiguousarray(consts[1].T)           # (N, K): a transposed copy

    @table.kernel(Op.MATMUL, supports_out=True, prepack=pack)
    def _mm(ctx: KernelContext, ins: Ins, attrs: Attrs, out: Out) -> list[Any]:
        seen.append(ctx.prepacked)
        w = ins[1] if ctx.prepacked is None else ctx.prepacked.T
        return [np.matmul(ins[0], w, out=None if out is None else out[0])]

    @table.kernel(Op.RELU, supports_out=True)
    def _relu(ctx: KernelContext, ins: Ins, attrs: Attrs, out: Out) -> list[Any]:
        seen.append(ctx.prepacked)
        return [np.maximum(ins[0], 0, out=None if out is None else out[0])]

    return table


# ---- prepacking -----------------------------------------------------------------------
def test_prepack_runs_once_per_model_and_reaches_the_kernel() -> None:
    seen: list[Any] = []
    calls: list[Any] = []
    table = prepacking_table(seen, calls)
    g = matmul_graph()
    pool = ArenaPool()
    x = np.linspace(-1, 1, 8, dtype=np.float32).reshape(2, 4)
    y = compile_with(table, g, {"x": (2, 4)}, pool).run({"x": x})["y"]
    compile_with(table, g, {"x": (5, 4)}, pool)          # another signature, same pool
    assert calls == [[False, True]]                       # once, with w and not x
    packed, relu_state = seen
    np.testing.assert_array_equal(packed, g.initializers["w"].T)
    assert relu_state is None                             # no prepack: no state
    np.testing.assert_allclose(y, np.maximum(x @ g.initializers["w"], 0), rtol=1e-6)


def test_a_prepack_returning_none_leaves_the_kernel_unpacked() -> None:
    table = KernelTable("fast")
    seen: list[Any] = []

    @table.kernel(Op.MATMUL, supports_out=True, prepack=lambda ctx, consts, attrs: None)
    def _mm(ctx: KernelContext, ins: Ins, attrs: Attrs, out: Out) -> list[Any]:
        seen.append(ctx.prepacked)
        return [np.matmul(ins[0], ins[1], out=None if out is None else out[0])]

    table.update(prepacking_table([], []))
    compile_with(table, matmul_graph(), {"x": (1, 4)}).run({"x": np.ones((1, 4), np.float32)})
    assert seen == [None]


def test_nodes_without_constant_inputs_are_not_prepacked() -> None:
    calls: list[Any] = []
    table = prepacking_table([], calls)
    t = TensorType(DType.FLOAT32, (2, 2))
    g = Graph("mm2", [node("mm", Op.MATMUL, ["a", "b"], ["y"])],
              [Value("a", t), Value("b", t)], [Value("y", t)])
    prog = compile_with(table, g, {"a": (2, 2), "b": (2, 2)})
    a = np.eye(2, dtype=np.float32)
    np.testing.assert_array_equal(prog.run({"a": a, "b": a * 3})["y"], a * 3)
    assert calls == []


def test_a_failing_prepack_names_the_node() -> None:
    table = KernelTable("fast")

    def boom(ctx: KernelContext, consts: Ins, attrs: Attrs) -> Any:
        raise ValueError("bad weights")

    table.kernel(Op.MATMUL, supports_out=True, prepack=boom)(
        lambda ctx, ins, attrs, out: [np.matmul(ins[0], ins[1])])
    table.update(prepacking_table([], []))
    with pytest.raises(ExecutionError, match=r"node 'mm': prepacking matmul \(default\) on "
                                             r"fast failed: ValueError: bad weights"):
        compile_with(table, matmul_graph(), {"x": (1, 4)})


def test_prepack_is_documented_and_optional_on_variants() -> None:
    table = prepacking_table([], [])
    assert table.get(Op.MATMUL).prepack is not None
    assert table.get(Op.RELU).prepack is None
    assert KernelContext(np, "x", cpu_backend.DeviceKind.CPU).prepacked is None


# ---- precompiled steps ----------------------------------------------------------------
def test_kernels_that_allocate_and_multiple_outputs_run_in_the_fast_loop() -> None:
    table = KernelTable("fast")

    @table.kernel(Op.SPLIT)
    def _split(ctx: KernelContext, ins: Ins, attrs: Attrs, out: Out) -> list[Any]:
        assert out is None                                # no supports_out: it allocates
        return list(np.split(ins[0], 2, axis=int(attrs["axis"])))

    @table.kernel(Op.ADD, supports_out=True)
    def _add(ctx: KernelContext, ins: Ins, attrs: Attrs, out: Out) -> list[Any]:
        return [np.add(ins[0], ins[1], out=None if out is None else out[0])]

    @table.kernel(Op.MUL, supports_out=True)
    def _mul(ctx: KernelContext, ins: Ins, attrs: Attrs, out: Out) -> list[Any]:
        return [np.multiply(ins[0], ins[1])]              # ignores its buffer

    t4, t2 = TensorType(DType.FLOAT32, (2, 4)), TensorType(DType.FLOAT32, (2, 2))
    split = Node("s", Op.SPLIT, ["x"], ["a", "b"], get_schema(Op.SPLIT).normalize_attrs(
        {"axis": 1, "num_outputs": 2}))
    g = Graph("sp", [split, node("m", Op.MUL, ["a", "b"], ["p"]),
                     node("o", Op.ADD, ["p", "a"], ["y"])],
              [Value("x", t4)], [Value("y", t2)])
    prog = compile_with(table, g, {"x": (2, 4)})
    x = np.arange(8, dtype=np.float32).reshape(2, 4)
    for _ in range(2):                                    # the second run reuses the views
        y = prog.run({"x": x})["y"]
        np.testing.assert_array_equal(y, x[:, :2] * x[:, 2:] + x[:, :2])


def test_errors_in_the_fast_loop_name_the_node_and_keep_keel_errors() -> None:
    table = prepacking_table([], [])

    @table.kernel(Op.SIGMOID, supports_out=True)
    def _bad(ctx: KernelContext, ins: Ins, attrs: Attrs, out: Out) -> list[Any]:
        raise InvalidArgumentError("sigmoid refused")

    t = TensorType(DType.FLOAT32, (2,))
    g = Graph("e", [node("r", Op.RELU, ["x"], ["h"]), node("bad", Op.SIGMOID, ["h"], ["y"])],
              [Value("x", t)], [Value("y", t)])
    prog = compile_with(table, g, {"x": (2,)})
    with pytest.raises(InvalidArgumentError, match="sigmoid refused") as info:
        prog.run({"x": np.ones(2, np.float32)})
    assert any("node 'bad'" in n for n in getattr(info.value, "__notes__", []))


def test_execute_takes_feeds_in_input_order() -> None:
    prog = compile_with(prepacking_table([], []), matmul_graph(), {"x": (3, 4)})
    assert prog.input_names == ["x"]
    x = np.ones((3, 4), np.float32)
    np.testing.assert_array_equal(prog.execute([x])["y"], prog.run({"x": x})["y"])


# ---- Model.predict fast path and frozen weights ---------------------------------------
def model_proto(dtype: Any = np.float32) -> onnx.ModelProto:
    """y = relu(x @ w.T): a Gemm and a Relu (float64 keeps the Gemm on BLAS)."""
    w = numpy_helper.from_array((np.arange(12).reshape(3, 4) / 7).astype(dtype), "w")
    elem = helper.np_dtype_to_tensor_dtype(np.dtype(dtype))
    nodes = [helper.make_node("Gemm", ["x", "w"], ["h"], transB=1, name="g"),
             helper.make_node("Relu", ["h"], ["y"], name="r")]
    graph = helper.make_graph(
        nodes, "gemm", [helper.make_tensor_value_info("x", elem, ["n", 4])],
        [helper.make_tensor_value_info("y", elem, ["n", 3])], [w])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def test_weights_are_frozen_at_load() -> None:
    m = load_model(model_proto(), backend="cpu")
    w = m.graph.initializers["w"]
    assert not w.flags.writeable
    with pytest.raises(ValueError, match="read-only"):
        w[0, 0] = 1.0


def test_loading_a_graph_leaves_the_callers_arrays_writable() -> None:
    g = matmul_graph()
    mine = np.ones((4, 3), np.float32)
    g.initializers["w"] = mine
    m = load_model(g, backend="cpu")
    assert mine.flags.writeable and not m.graph.initializers["w"].flags.writeable


def test_repeated_predicts_skip_validation_but_never_wrong_inputs() -> None:
    m = load_model(model_proto(), backend="cpu")
    x = np.random.default_rng(0).standard_normal((2, 4)).astype(np.float32)
    first = m.predict({"x": x})["y"]
    second = m.predict({"x": x})["y"]                     # the remembered signature
    assert first is not second and not np.shares_memory(first, second)
    np.testing.assert_array_equal(first, second)
    with pytest.raises(InvalidArgumentError, match="dtype float64"):
        m.predict({"x": x.astype(np.float64)})
    with pytest.raises(InvalidArgumentError, match="unknown input 'z'"):
        m.predict({"x": x, "z": x})
    strided = np.asfortranarray(x)                        # not C-contiguous: the slow path
    np.testing.assert_array_equal(m.predict({"x": strided})["y"], first)
    other = m.predict({"x": np.ones((5, 4), np.float32)})["y"]
    assert other.shape == (5, 3)
    assert m.plan.input_shapes == {"x": (5, 4)}


def test_a_converted_precision_still_checks_declared_dtypes() -> None:
    m = load_model(model_proto(), backend="cpu", precision="fp64")
    x = np.ones((2, 4), np.float32)
    for _ in range(2):
        assert m.predict({"x": x})["y"].dtype == np.float32   # declared, not computed
    with pytest.raises(InvalidArgumentError, match="dtype float64; expected float32"):
        m.predict({"x": x.astype(np.float64)})


def test_a_new_memory_limit_forgets_the_remembered_signatures() -> None:
    proto = mlp(in_features=16, hidden=(32, 16), classes=4)
    feeds = make_inputs(proto, 64, seed=7)
    m = load_model(proto, backend="cpu")
    small = m.plan.peak_bytes                             # batch 1
    whole = m.predict(feeds)["probs"]
    whole = m.predict(feeds)["probs"]                     # remembered now
    m.set_memory_limit((m.plan.peak_bytes + small) // 2)  # fits only in chunks
    np.testing.assert_allclose(m.predict(feeds)["probs"], whole, rtol=1e-6, atol=1e-7)
    assert m.plan.chunk_size_hint is not None


# ---- thread caps ----------------------------------------------------------------------
class FakePool:
    def __init__(self, threads: int) -> None:
        self.threads = threads
        self.sets: list[int] = []
        self.cleared = 0

    def get_num_threads(self) -> int:
        return self.threads

    def set_num_threads(self, n: int) -> None:
        self.sets.append(n)
        self.threads = n

    def clear_controlling_thread(self) -> None:
        self.cleared += 1


def test_thread_cap_sets_only_pools_that_differ_and_restores_them(
        monkeypatch: pytest.MonkeyPatch) -> None:
    same, other = FakePool(2), FakePool(8)
    monkeypatch.setattr(cpu_backend, "_pools", lambda: (same, other))
    with cpu_backend.ThreadCap(2):
        assert (same.threads, other.threads) == (2, 2)
    assert same.sets == [] and other.sets == [2, 8] and other.cleared == 1


def test_a_cpu_program_runs_under_its_thread_cap(monkeypatch: pytest.MonkeyPatch) -> None:
    pool = FakePool(4)
    monkeypatch.setattr(cpu_backend, "_pools", lambda: (pool,))
    seen: list[int] = []
    real = cpu_backend.ThreadCap.__enter__

    def spy(self: cpu_backend.ThreadCap) -> cpu_backend.ThreadCap:
        result = real(self)
        seen.append(pool.threads)
        return result

    monkeypatch.setattr(cpu_backend.ThreadCap, "__enter__", spy)
    m = load_model(model_proto(np.float64), backend="cpu", threads=1)    # BLAS, native or not
    x = np.ones((2, 4), np.float64)
    m.predict({"x": x})                                   # compiles (allocating enters too)
    seen.clear()
    pool.sets.clear()
    m.predict({"x": x})
    m.predict({"x": x})
    # Every BLAS call runs capped; the pool is set once per run, then restored (a kernel's
    # own cap inside the run finds the pool already at 1 and leaves it alone).
    assert seen and set(seen) == {1} and pool.threads == 4
    assert pool.sets == [1, 4, 1, 4]


class FakeOpenBLAS:
    internal_api = "openblas"

    def __init__(self, layer: str = "pthreads", symbols: bool = True) -> None:
        self.threading_layer = layer
        self.value = 2
        self.symbols = symbols

    def _get_symbol(self, name: str) -> Any:
        if not self.symbols:
            raise AttributeError(name)
        if name == "openblas_get_num_threads":
            return lambda: self.value
        return lambda n: setattr(self, "value", n)


def test_openblas_pthreads_pools_are_set_through_their_c_entry_points() -> None:
    lib = FakeOpenBLAS()
    pool = cpu_backend._direct(lib)
    assert pool is not lib
    pool.set_num_threads(1)
    assert pool.get_num_threads() == 1 == lib.value
    # OpenMP builds keep per-thread limits, and other controllers keep their methods.
    openmp, bare = FakeOpenBLAS("openmp"), FakeOpenBLAS(symbols=False)
    assert cpu_backend._direct(openmp) is openmp and cpu_backend._direct(bare) is bare


def test_a_native_variant_handing_a_case_to_blas_caps_it(monkeypatch: pytest.MonkeyPatch) -> None:
    """A program of native variants runs without the cap; what they hand to BLAS caps it."""
    from keel.backends.base import DeviceKind, KernelContext
    from keel.backends.cpu.kernels import load as load_cpu
    from keel.ops.registry import Op
    from keel.ops.schema import get_schema

    pool = FakePool(4)
    monkeypatch.setattr(cpu_backend, "_pools", lambda: (pool,))
    kernel = load_cpu().get(Op.MATMUL, "native").fn
    ctx = KernelContext(np, "cpu", DeviceKind.CPU, threads=1)
    rng = np.random.default_rng(0)
    a = rng.standard_normal((2, 3, 4)).astype(np.float32)
    b = rng.standard_normal((2, 4, 5)).astype(np.float32)       # 3-D B: BLAS's case
    got = kernel(ctx, [a, b], get_schema(Op.MATMUL).normalize_attrs({}), None)[0]
    np.testing.assert_allclose(got, a @ b, rtol=1e-5, atol=1e-5)
    assert pool.sets == [1, 4] and pool.threads == 4
