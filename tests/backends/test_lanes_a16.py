"""A conv whose products run wholly in lanes tiles with A in 16-row panels (the planner's
lanes_a16) holds its filters packed once, in those panels only, on every path that runs
it: bound and unbound runs at 1, 2, 3 and 16 threads, the same bits as the 8-row panels,
its prepared calls reading that pack as 16-row panels (the model's own prepare, no field
written by hand), and the memory plan's packed-weight bytes cover what it holds. The plan
carries the choice (gemm_a16, the planner's native_a16): a plan made for another
machine's profile packs, binds and says what that machine's vendor and tile decide."""

from __future__ import annotations

import gc
import types
from typing import Any

import numpy as np
import pytest
from onnx import TensorProto, helper, numpy_helper

from keel import native
from keel.backends.cpu import native_gemm
from keel.backends.cpu import planner as cpu_planner
from keel.execution.model import load_model
from keel.hardware.fakes import fake_profile


@pytest.fixture(autouse=True)
def _lanes_built() -> None:
    if not native_gemm.available():
        pytest.skip(f"native tier unavailable: {native.status().reason}")
    if native_gemm.geometry() != (8, 32):
        pytest.skip("lanes tiles are built only with AVX-512 8 x 32 tiles; this build's "
                    f"tile is {native_gemm.geometry()}")


def _projection(rows: int, depth: int, side: int, seed: int = 0) -> tuple[bytes, np.ndarray]:
    """A 1x1 conv (depth -> rows channels, bias) on side x side, then y = conv + x's first
    rows channels (MobileNetV2's 14x14 projection with its residual), and its filters."""
    rng = np.random.default_rng(seed)
    w = (rng.standard_normal((rows, depth, 1, 1)) * 0.1).astype(np.float32)
    b = rng.standard_normal(rows).astype(np.float32)
    z = rng.standard_normal((1, rows, side, side)).astype(np.float32)
    nodes = [helper.make_node("Conv", ["x", "w", "b"], ["c"]),
             helper.make_node("Add", ["c", "z"], ["y"])]
    graph = helper.make_graph(
        nodes, "projection",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, depth, side, side]),
         helper.make_tensor_value_info("z", TensorProto.FLOAT, [1, rows, side, side])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
        [numpy_helper.from_array(w, "w"), numpy_helper.from_array(b, "b")])
    del z
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    return model.SerializeToString(), w.reshape(rows, depth)


def _reachable(root: object) -> list[Any]:
    """Every object ``root`` holds, once, modules, classes and functions not followed."""
    seen: dict[int, Any] = {}
    stack: list[Any] = [root]
    while stack:
        o = stack.pop()
        if id(o) in seen or isinstance(o, (types.ModuleType, type, types.FunctionType,
                                           types.BuiltinFunctionType)):
            continue
        seen[id(o)] = o
        stack.extend(gc.get_referents(o))
    return list(seen.values())


def _reachable_arrays(root: object) -> list[np.ndarray]:
    """Every array ``root`` holds (the memory under each, once)."""
    found: dict[int, np.ndarray] = {}
    for o in _reachable(root):
        if isinstance(o, np.ndarray):
            base = o
            while isinstance(base.base, np.ndarray):
                base = base.base
            found[id(base)] = base
    return list(found.values())


def _a16_fields(model: Any) -> list[tuple[int, int]]:
    """(A's address, the 16-row panels' address: keel_gemm_args' a16) of each GEMM call
    ``model`` holds prepared."""
    return [(int(o.values[native_gemm._A_FIELD]), int(o.values[native_gemm._FLAGS_FIELD + 1]))
            for o in _reachable(model) if isinstance(o, native_gemm.Call)]


def _packings(model: Any, w: np.ndarray) -> list[np.ndarray]:
    """The arrays ``model`` holds that hold every one of ``w``'s values (random normals:
    a copy of ``w`` laid out again), the initializer read from the model's bytes left
    out."""
    return [a for a in _reachable_arrays(model)
            if a.dtype == np.float32 and a.size >= w.size and not isinstance(a.base, bytes)
            and np.isin(w, a).all()]


def _bits(a: Any) -> np.ndarray:
    return np.ascontiguousarray(np.asarray(a, dtype=np.float32)).view(np.uint32)


@pytest.mark.parametrize("rows", [64, 72])        # 72: an odd count of 8-row panels
def test_a_lanes_a16_conv_holds_its_filters_packed_once(
        rows: int, monkeypatch: pytest.MonkeyPatch) -> None:
    onnx, w = _projection(rows, 384, 14)
    rng = np.random.default_rng(1)
    feeds = {"x": rng.standard_normal((1, 384, 14, 14)).astype(np.float32),
             "z": rng.standard_normal((1, rows, 14, 14)).astype(np.float32)}
    monkeypatch.setattr(cpu_planner, "LANES_A16_VENDORS", frozenset())
    eight = load_model(onnx, backend="cpu", threads=1, plan_cache=False)
    want = eight.predict(feeds)["y"]
    ref = load_model(onnx, backend="reference").predict(feeds)["y"]
    np.testing.assert_allclose(np.asarray(want), np.asarray(ref), rtol=1e-4, atol=1e-4)
    assert [a.nbytes for a in _packings(eight, w)] == [4 * -(-rows // 8) * 8 * 384 + 64]
    assert {a16 for _, a16 in _a16_fields(eight)} == {0}
    monkeypatch.setattr(cpu_planner, "LANES_A16_VENDORS", frozenset({"Intel", "AMD", None}))
    for threads in (1, 2, 3, 16):
        model = load_model(onnx, backend="cpu", threads=threads, plan_cache=False)
        assert "its filters packed that way only (lanes_a16" in model.explain()
        for _ in range(3):                      # the first runs bind, the last is steady
            got = model.predict(feeds)["y"]
        assert np.array_equal(_bits(got), _bits(want)), threads
        held = _packings(model, w)
        # One packing, in 16-row panels (a last odd 8-row panel beside zeros), within
        # the memory plan's packed-weight bytes.
        assert [a.nbytes for a in held] == [4 * -(-rows // 16) * 16 * 384 + 64], threads
        # The conv's prepared calls read them as such: each one's a16 is its A, that pack.
        fields = _a16_fields(model)
        assert fields and all(a == a16 and held[0].ctypes.data <= a
                              < held[0].ctypes.data + held[0].nbytes for a, a16 in fields)
        plan = model.plan.memory_plan
        assert plan is not None and sum(a.nbytes for a in held) <= plan.prepacked_bytes


# (profile, products in lanes tiles, filters in 16-row panels): an Intel Xeon with
# AVX-512 (8 x 32 tiles), an AMD Ryzen with AVX-512 (lanes tiles, 16-row panels not
# measured there), an Intel Core and an AMD EPYC with AVX2 (6 x 16 tiles: no lanes tiles).
PLANNED_FOR = [("x86-avx512-server", True, True), ("amd-sysfs-only", True, False),
               ("windows-rtx4090", False, False), ("amd-rocm-server", False, False)]


@pytest.mark.parametrize(("name", "lanes", "a16"), PLANNED_FOR)
def test_the_plan_decides_the_16_row_panels_for_the_machine_planned_for(
        name: str, lanes: bool, a16: bool) -> None:
    """The plan carries the 16-row panels' choice (gemm_a16) made for the profile's vendor
    and tile, whatever this machine's: the filters are packed as it says (one packing),
    the prepared calls read A as it says, explain() says it with its reason, and the
    outputs are bitwise the same at 1, 2, 3 and 16 threads and for every profile."""
    rows = 72                                   # an odd count of 8-row panels
    onnx, w = _projection(rows, 384, 14)
    rng = np.random.default_rng(2)
    feeds = {"x": rng.standard_normal((1, 384, 14, 14)).astype(np.float32),
             "z": rng.standard_normal((1, rows, 14, 14)).astype(np.float32)}
    ref = load_model(onnx, backend="reference").predict(feeds)["y"]
    width = 16 if a16 else 8
    want: np.ndarray | None = None
    for threads in (1, 2, 3, 16):
        model = load_model(onnx, backend="cpu", threads=threads, plan_cache=False,
                           hardware=fake_profile(name))
        (conv,) = [n.plan for n in model.plan.nodes if n.plan is not None]
        assert conv.layout == "direct" and conv.option("gemm_lanes") is lanes
        assert conv.option("gemm_a16") is (a16 if lanes else None)
        said = model.explain()
        assert ("gemm_a16: True (A in 16-row panels" in said) is a16
        assert ("gemm_a16: False (A in 8-row panels" in said) is (lanes and not a16)
        for _ in range(3):                      # the first runs bind, the last is steady
            got = _bits(model.predict(feeds)["y"])
        want = got if want is None else want
        assert np.array_equal(got, want), (name, threads)
        held = _packings(model, w)
        assert [a.nbytes for a in held] == [4 * -(-rows // width) * width * 384 + 64]
        fields = _a16_fields(model)
        assert fields and all((a16_field == a) is a16 and (a16_field == 0) is not a16
                              for a, a16_field in fields), (name, threads)
    np.testing.assert_allclose(want.view(np.float32), np.asarray(ref), rtol=1e-4, atol=1e-4)


def test_every_profile_gives_the_same_bits() -> None:
    """16-row panels, 8-row panels, lanes tiles and column panels sum each element the
    same way: the plans of every profile above give one result, bit for bit."""
    onnx, _ = _projection(72, 384, 14)
    rng = np.random.default_rng(3)
    feeds = {"x": rng.standard_normal((1, 384, 14, 14)).astype(np.float32),
             "z": rng.standard_normal((1, 72, 14, 14)).astype(np.float32)}
    got = {name: _bits(load_model(onnx, backend="cpu", threads=2, plan_cache=False,
                                  hardware=fake_profile(name)).predict(feeds)["y"]).tobytes()
           for name, _, _ in PLANNED_FOR}
    assert len(set(got.values())) == 1, sorted(got)
