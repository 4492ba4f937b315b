"""The executor: flat steps over arena views, no steady-state allocation, copies, profiling."""

from __future__ import annotations

import functools
import json
import tracemalloc
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from keel.backends.base import DeviceKind, KernelContext, KernelTable
from keel.backends.registry import BackendRegistry
from keel.dtypes import DType
from keel.errors import ExecutionError, InvalidArgumentError
from keel.execution.program import Profiler, Program, compile_program
from keel.graph.ir import Graph, Node, Value
from keel.graph.shape_inference import infer_graph_types
from keel.ops.registry import Op
from keel.ops.schema import get_schema
from keel.ops.types import TensorType
from keel.planning.placement import place
from keel.testing.backends import FakeBackend

# ---- out-capable NumPy kernels without temporaries ---------------------------
TABLE = KernelTable("fast")
Ins = Sequence[Any]
Out = Sequence[Any] | None


@TABLE.kernel(Op.ADD, supports_out=True)
def _add(ctx: KernelContext, ins: Ins, attrs: Mapping[str, Any], out: Out) -> list[Any]:
    return [np.add(ins[0], ins[1], out=None if out is None else out[0])]


@TABLE.kernel(Op.MUL, supports_out=True)
def _mul(ctx: KernelContext, ins: Ins, attrs: Mapping[str, Any], out: Out) -> list[Any]:
    return [np.multiply(ins[0], ins[1], out=None if out is None else out[0])]


@TABLE.kernel(Op.RELU, supports_out=True)
def _relu(ctx: KernelContext, ins: Ins, attrs: Mapping[str, Any], out: Out) -> list[Any]:
    return [np.maximum(ins[0], 0, out=None if out is None else out[0])]


@TABLE.kernel(Op.MATMUL, supports_out=True)
def _matmul(ctx: KernelContext, ins: Ins, attrs: Mapping[str, Any], out: Out) -> list[Any]:
    return [np.matmul(ins[0], ins[1], out=None if out is None else out[0])]


@TABLE.kernel(Op.RESHAPE)
def _reshape(ctx: KernelContext, ins: Ins, attrs: Mapping[str, Any], out: Out) -> list[Any]:
    # Returns a *view* of its input, as NumPy kernels that allocate may well do.
    return [ins[0].reshape(tuple(int(d) for d in ins[1]))]


def _reshape_into(ctx: KernelContext, ins: Ins, attrs: Mapping[str, Any], out: Out) -> list[Any]:
    y = ins[0].reshape(tuple(int(d) for d in ins[1]))
    if out is None:
        return [y.copy()]
    out[0][...] = y
    return [out[0]]


# The same kernels, with a reshape that writes into a given buffer.
VIEWS = KernelTable("fast")
VIEWS.kernel(Op.RESHAPE, supports_out=True)(_reshape_into)


@TABLE.kernel(Op.SIGMOID)
def _broken(ctx: KernelContext, ins: Ins, attrs: Mapping[str, Any], out: Out) -> list[Any]:
    raise ZeroDivisionError("boom")


VIEWS.update(TABLE)


def node(name: str, op: Op, inputs: list[str], outputs: list[str]) -> Node:
    return Node(name, op, inputs, outputs, get_schema(op).normalize_attrs({}))


def registry_of(*backends: FakeBackend) -> BackendRegistry:
    reg = BackendRegistry()
    for i, b in enumerate(backends):
        reg.register(b.name, functools.partial(lambda x: x, b), priority=100 - i)
    return reg


def build(graph: Graph, shapes: dict[str, tuple[int, ...]], *backends: FakeBackend,
          backend: str = "auto") -> Program:
    reg = registry_of(*(backends or (FakeBackend("fast", table=TABLE),)))
    types = infer_graph_types(graph, shapes)
    plan = place(graph, types, reg, backend=backend)
    used = {name: reg.get(name) for name in plan.backends}
    return compile_program(graph, plan, types, used)


def chain_graph(n: int = 6) -> Graph:
    """x -> matmul -> (relu, add x, mul x)* -> y: every intermediate the size of x."""
    t = TensorType(DType.FLOAT32, ("batch", 256))
    nodes = [node("mm", Op.MATMUL, ["x", "w"], ["v0"])]
    for i in range(1, n):
        op = (Op.RELU, Op.ADD, Op.MUL)[i % 3]
        ins = [f"v{i - 1}"] + ([] if op is Op.RELU else ["x"])
        nodes.append(node(f"n{i}", op, ins, [f"v{i}"]))
    nodes.append(node("last", Op.ADD, [f"v{n - 1}", "x"], ["y"]))
    w = (np.random.default_rng(0).standard_normal((256, 256)) / 16).astype(np.float32)
    return Graph("chain", nodes, [Value("x", t)], [Value("y", t)], initializers={"w": w})


def chain_expected(x: np.ndarray, w: np.ndarray, n: int = 6) -> np.ndarray:
    v = x @ w
    for i in range(1, n):
        v = (np.maximum(v, 0), v + x, v * x)[i % 3]
    return v + x


def test_program_matches_numpy() -> None:
    g = chain_graph()
    prog = build(g, {"x": (64, 256)})
    x = np.random.default_rng(1).standard_normal((64, 256)).astype(np.float32)
    y = prog.run({"x": x})["y"]
    np.testing.assert_allclose(y, chain_expected(x, g.initializers["w"]), rtol=1e-5, atol=1e-5)


def test_every_intermediate_is_a_view_of_the_arena() -> None:
    prog = build(chain_graph(), {"x": (64, 256)})
    views = prog.planned_values()
    assert set(views) == {f"v{i}" for i in range(6)}
    arena = prog.arena("cpu")
    for name, view in views.items():
        assert np.shares_memory(view, arena), name
    x = np.ones((64, 256), np.float32)
    prog.run({"x": x})
    # In-place reuse: the six values share far fewer than six buffers.
    assert arena.nbytes <= 2 * 64 * 256 * 4


def test_arena_is_64_byte_aligned() -> None:
    prog = build(chain_graph(), {"x": (3, 256)})
    prog.run({"x": np.ones((3, 256), np.float32)})
    assert prog.arena("cpu").__array_interface__["data"][0] % 64 == 0


def test_steady_state_allocates_only_the_outputs() -> None:
    prog = build(chain_graph(), {"x": (256, 256)})
    x = np.random.default_rng(2).standard_normal((256, 256)).astype(np.float32)
    prog.run({"x": x})                       # first run binds the arena
    out_bytes = 256 * 256 * 4
    tracemalloc.start()
    try:
        tracemalloc.reset_peak()
        before = tracemalloc.get_traced_memory()[0]
        for _ in range(3):
            result = prog.run({"x": x})
            del result
        peak = tracemalloc.get_traced_memory()[1] - before
    finally:
        tracemalloc.stop()
    # Six 256 KiB intermediates run per call; only the 256 KiB output is new.
    assert peak < out_bytes + 64 * 1024, peak


def test_outputs_are_fresh_arrays() -> None:
    prog = build(chain_graph(), {"x": (4, 256)})
    x = np.ones((4, 256), np.float32)
    a = prog.run({"x": x})["y"]
    b = prog.run({"x": x})["y"]
    assert a is not b and not np.shares_memory(a, b)
    assert not np.shares_memory(a, prog.arena("cpu"))
    np.testing.assert_array_equal(a, b)


def test_reshape_sharing_its_input_bytes_is_free() -> None:
    t = TensorType(DType.FLOAT32, (4, 6))
    shape = np.array([6, 4], np.int64)
    g = Graph("r", [node("a", Op.RELU, ["x"], ["h"]),
                    node("r", Op.RESHAPE, ["h", "s"], ["h2"]),
                    node("b", Op.RELU, ["h2"], ["y"])],
              [Value("x", t)], [Value("y", TensorType(DType.FLOAT32, (6, 4)))],
              initializers={"s": shape})
    # The reshape's output shares h's bytes (h dies there): it does not run at all.
    prog = build(g, {"x": (4, 6)}, FakeBackend("fast", table=VIEWS))
    assert [s[0] for s in prog.steps] == ["a", "b"]
    views = prog.planned_values()
    assert np.shares_memory(views["h"], views["h2"]) and views["h2"].shape == (6, 4)
    x = np.arange(-12, 12, dtype=np.float32).reshape(4, 6)
    np.testing.assert_array_equal(prog.run({"x": x})["y"], np.maximum(x, 0).reshape(6, 4))


def test_kernel_returning_a_view_does_not_see_its_bytes_reused() -> None:
    # r = reshape(h) is a view of h made by a kernel that allocates; the planner
    # must keep h's bytes alive until r's last reader (k), although h itself is
    # not read after the reshape.
    t = TensorType(DType.FLOAT32, (8, 8))
    g = Graph("v", [node("h", Op.RELU, ["x"], ["h"]),
                    node("r", Op.RESHAPE, ["h", "s"], ["r"]),
                    node("j", Op.MUL, ["x", "x"], ["j"]),
                    node("k", Op.ADD, ["r", "j"], ["y"])],
              [Value("x", t)], [Value("y", t)],
              initializers={"s": np.array([8, 8], np.int64)})
    types = infer_graph_types(g, {"x": (8, 8)})
    reg = registry_of(FakeBackend("fast", table=TABLE))
    plan = place(g, types, reg)
    assert plan.memory_plan is not None
    assert plan.memory_plan.allocation("h").last >= 3
    prog = compile_program(g, plan, types, {"fast": reg.get("fast")})
    x = np.random.default_rng(3).standard_normal((8, 8)).astype(np.float32)
    np.testing.assert_allclose(prog.run({"x": x})["y"], np.maximum(x, 0) + x * x)


def test_copies_between_devices_run() -> None:
    # 10.6 MB of matmul input is over the GPU crossover; the fake GPU backend
    # has only matmul, so the relu runs on the host and h is copied back.
    x_t = TensorType(DType.FLOAT32, (2600, 1024))
    w = np.random.default_rng(4).standard_normal((1024, 4)).astype(np.float32)
    g = Graph("dev", [node("mm", Op.MATMUL, ["x", "w"], ["h"]),
                      node("act", Op.RELU, ["h"], ["y"])],
              [Value("x", x_t)], [Value("y", TensorType(DType.FLOAT32, (2600, 4)))],
              initializers={"w": w})
    gpu = FakeBackend("gpu", DeviceKind.GPU, ops={Op.MATMUL})
    prog = build(g, {"x": (2600, 1024)}, gpu, FakeBackend("fast", table=TABLE))
    assert [s[0] for s in prog.steps] == ["copy:x@gpu", "mm", "copy:h@cpu", "act"]
    assert gpu.copies_in == 1                 # the weight, loaded once at compile
    x = np.random.default_rng(5).standard_normal((2600, 1024)).astype(np.float32)
    y = prog.run({"x": x})["y"]
    assert gpu.copies_in == 2                 # plus x, once per run
    np.testing.assert_allclose(y, np.maximum(x @ w, 0), rtol=1e-4, atol=1e-4)


def test_kernel_failure_names_the_node() -> None:
    t = TensorType(DType.FLOAT32, (2, 2))
    g = Graph("f", [node("bad", Op.SIGMOID, ["x"], ["y"])], [Value("x", t)], [Value("y", t)])
    prog = build(g, {"x": (2, 2)})
    with pytest.raises(ExecutionError, match="node 'bad': sigmoid on fast failed: "
                                             "ZeroDivisionError: boom"):
        prog.run({"x": np.ones((2, 2), np.float32)})


def test_feeds_must_match_the_compiled_signature() -> None:
    prog = build(chain_graph(), {"x": (4, 256)})
    with pytest.raises(InvalidArgumentError, match=r"input 'x' is float32\[5, 256\]; this "
                                                   r"program was compiled for float32\[4, 256\]"):
        prog.run({"x": np.ones((5, 256), np.float32)})
    with pytest.raises(InvalidArgumentError, match="input 'x' is missing"):
        prog.run({})


def test_profiler_times_every_node_and_exports_a_chrome_trace(tmp_path: Any) -> None:
    prog = build(chain_graph(), {"x": (4, 256)})
    profiler = Profiler()
    prog.run({"x": np.ones((4, 256), np.float32)}, profiler=profiler)
    names = [e.name for e in profiler.events]
    assert names == [s[0] for s in prog.steps]
    path = profiler.export(tmp_path / "trace.json")
    trace = json.loads(Path(path).read_text())
    nodes = [e for e in trace if e["cat"] == "Node"]
    assert len(nodes) == len(names)
    for e in nodes:
        assert e["ph"] == "X" and e["dur"] >= 0 and e["name"].endswith("_kernel_time")
        assert e["args"]["provider"] == "fast" and e["args"]["op_name"]
    assert [e["name"] for e in trace if e["cat"] == "Session"] == ["model_run"]
    assert set(profiler.node_totals()) == set(names)


def test_keep_all_returns_every_intermediate() -> None:
    g = chain_graph(3)
    prog = build(g, {"x": (2, 256)})
    x = np.ones((2, 256), np.float32)
    values = prog.run({"x": x}, keep_all=True)
    assert {"v0", "v1", "v2", "y"} <= set(values)
    np.testing.assert_allclose(values["v0"], x @ g.initializers["w"], rtol=1e-6)


def test_given_output_buffers_receive_the_results() -> None:
    prog = build(chain_graph(), {"x": (4, 256)})
    x = np.ones((4, 256), np.float32)
    target = np.zeros((8, 256), np.float32)
    got = prog.run({"x": x}, outputs={"y": target[4:]})["y"]
    assert np.shares_memory(got, target)
    np.testing.assert_array_equal(target[4:], prog.run({"x": x})["y"])
    assert not target[:4].any()


def test_a_kernel_ignoring_its_buffer_still_feeds_a_free_view() -> None:
    def relu_fresh(ctx: KernelContext, ins: Ins, attrs: Mapping[str, Any], out: Out) -> list[Any]:
        return [np.maximum(ins[0], 0)]           # claims supports_out, allocates anyway

    table = KernelTable("fast")
    table.kernel(Op.RELU, supports_out=True)(relu_fresh)
    table.update(VIEWS)
    t = TensorType(DType.FLOAT32, (4, 6))
    g = Graph("r", [node("a", Op.RELU, ["x"], ["h"]),
                    node("r", Op.RESHAPE, ["h", "s"], ["h2"]),
                    node("b", Op.ADD, ["h2", "h2"], ["y"])],
              [Value("x", t)], [Value("y", TensorType(DType.FLOAT32, (6, 4)))],
              initializers={"s": np.array([6, 4], np.int64)})
    prog = build(g, {"x": (4, 6)}, FakeBackend("fast", table=table))
    assert [s[0] for s in prog.steps] == ["a", "b"]
    x = np.arange(-12, 12, dtype=np.float32).reshape(4, 6)
    for _ in range(2):
        np.testing.assert_array_equal(prog.run({"x": x})["y"], 2 * np.maximum(x, 0).reshape(6, 4))
