"""A network's first conv pooled while its rows are in cache (planner.pool_in_conv,
conv_pool, gemm.c's keel_conv_pool_f32): where the rule applies, what explain() says,
and the fused plan's results bitwise the unfused plan's on 1, 2, 3 and 16 threads, at
batch 1 and 2, and close to the reference backend."""

from __future__ import annotations

import threading
from typing import Any

import numpy as np
import onnx as onnx_lib
import pytest
from onnx import TensorProto, helper, numpy_helper

from keel import native
from keel.backends.cpu import conv_pool, native_gemm, native_window
from keel.backends.cpu import planner as cpu_planner
from keel.execution.model import load_model
from keel.ops.registry import Op


@pytest.fixture(autouse=True)
def _native_tier() -> None:
    if not (native_gemm.available() and native_window.ready()):
        pytest.skip(f"native tier unavailable: {native.status().reason}")


def _stem(batch: int, channels: int = 3, size: int = 128, pool: dict[str, Any] | None = None,
          second_reader: bool = False, seed: int = 0, conv: dict[str, Any] | None = None,
          overridable: tuple[str, ...] = (), width: int | None = None) -> bytes:
    """Conv (channels -> 64, 7x7 stride 2 pad 3 unless ``conv``, bias) + ReLU + MaxPool
    (3x3 stride 2 pad 1 unless ``pool``), as ResNet-18 begins, then the pool's output
    doubled; ``second_reader``: the conv's output is a graph output too; ``overridable``:
    initializers listed as graph inputs too (as IR-3 exports list every one); ``width``:
    the image's width where it is not ``size``."""
    rng = np.random.default_rng(seed)
    attrs = conv or {"kernel_shape": [7, 7], "strides": [2, 2], "pads": [3, 3, 3, 3]}
    w = (rng.standard_normal((64, channels, *attrs["kernel_shape"])) * 0.1).astype(np.float32)
    b = rng.standard_normal(64).astype(np.float32)
    window = pool or {"kernel_shape": [3, 3], "strides": [2, 2], "pads": [1, 1, 1, 1]}
    nodes = [helper.make_node("Conv", ["x", "w", "b"], ["c"], **attrs),
             helper.make_node("Relu", ["c"], ["r"]),
             helper.make_node("MaxPool", ["r"], ["p"], **window),
             # y = p + p (exact): the pool's output is no graph output, as in a network,
             # so its step binds whatever its size.
             helper.make_node("Add", ["p", "p"], ["y"])]
    outputs = [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)]
    if second_reader:
        outputs.append(helper.make_tensor_value_info("r", TensorProto.FLOAT, None))
    inputs = [helper.make_tensor_value_info("x", TensorProto.FLOAT,
                                            [batch, channels, size, width or size])]
    inputs += [helper.make_tensor_value_info(name, TensorProto.FLOAT, list(value.shape))
               for name, value in (("w", w), ("b", b)) if name in overridable]
    graph = helper.make_graph(
        nodes, "stem", inputs, outputs,
        [numpy_helper.from_array(w, "w"), numpy_helper.from_array(b, "b")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    return model.SerializeToString()


def _load(onnx: bytes, threads: int, fused: bool, monkeypatch: pytest.MonkeyPatch) -> Any:
    monkeypatch.setattr(cpu_planner, "POOL_IN_CONV", fused)
    return load_model(onnx, backend="cpu", threads=threads, plan_cache=False)


def _pool_steps(model: Any) -> list[conv_pool.PoolStep]:
    program = next(p.program for p in model._cache.values() if p.program is not None)
    found: list[conv_pool.PoolStep] = []
    # The bound calls of a steady run, else the steps' entries (a step reading a large
    # feed runs unbound); a graph output's step is held: its call wrapped.
    calls = program._calls or [c for hot in program._hot for c in hot if callable(c)]
    for call in calls:
        call = getattr(call, "fn", call)           # a BoundCall's function
        parts = (call, *getattr(call, "args", ()))
        found += [c for c in parts if isinstance(c, conv_pool.PoolStep)]
    return found


def _bits(a: Any) -> np.ndarray:
    return np.ascontiguousarray(np.asarray(a, dtype=np.float32)).view(np.uint32)


@pytest.mark.parametrize("batch", [1, 2])
@pytest.mark.parametrize("size", [128, 131, 150])  # 150: a feed over STAGE_FEED_BYTES
def test_the_fused_plan_gives_the_unfused_bits_on_any_thread_count(
        batch: int, size: int, monkeypatch: pytest.MonkeyPatch) -> None:
    onnx = _stem(batch, size=size)
    x = np.random.default_rng(1).standard_normal((batch, 3, size, size)).astype(np.float32)
    x[0, 0, 5, 7] = np.nan                      # NaN reaches the pool: it keeps it
    want = _load(onnx, 1, False, monkeypatch).predict({"x": x})["y"]
    ref = load_model(onnx, backend="reference").predict({"x": x})["y"]
    np.testing.assert_allclose(np.asarray(want), np.asarray(ref), rtol=1e-4, atol=1e-4)
    assert np.isnan(np.asarray(want)).any()
    for threads in (1, 2, 3, 16):
        model = _load(onnx, threads, True, monkeypatch)
        for _ in range(3):                      # the first runs bind, the last is steady
            got = model.predict({"x": x})["y"]
        steps = _pool_steps(model)
        assert len(steps) == 1 and steps[0].fused is not None      # it did run fused
        assert np.array_equal(_bits(got), _bits(want)), threads
        x2 = x + 1.0                            # another X: the call follows it
        assert np.array_equal(
            _bits(model.predict({"x": x2})["y"]),
            _bits(_load(onnx, 1, False, monkeypatch).predict({"x": x2})["y"]))


@pytest.mark.parametrize("conv", [
    # Taps of another phase layout: a dilated kernel (its taps two rows apart fall in
    # one phase), strides unequal across, pads unequal.
    {"kernel_shape": [5, 5], "strides": [2, 2], "pads": [4, 4, 4, 4], "dilations": [2, 2]},
    {"kernel_shape": [3, 5], "strides": [2, 1], "pads": [1, 2, 0, 1]},
    {"kernel_shape": [4, 4], "strides": [2, 2], "pads": [0, 3, 2, 1]},
])
def test_other_conv_geometries_give_the_unfused_bits(conv: dict[str, Any],
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    onnx = _stem(2, size=130, conv=conv)
    x = np.random.default_rng(3).standard_normal((2, 3, 130, 130)).astype(np.float32)
    want = _load(onnx, 1, False, monkeypatch).predict({"x": x})["y"]
    ref = load_model(onnx, backend="reference").predict({"x": x})["y"]
    np.testing.assert_allclose(np.asarray(want), np.asarray(ref), rtol=1e-4, atol=1e-4)
    for threads in (1, 3):
        model = _load(onnx, threads, True, monkeypatch)
        for _ in range(2):
            got = model.predict({"x": x})["y"]
        steps = _pool_steps(model)
        assert len(steps) == 1 and steps[0].fused is not None, conv
        assert np.array_equal(_bits(got), _bits(want)), (conv, threads)


_POOL3 = {"kernel_shape": [3, 3], "strides": [2, 2], "pads": [1, 1, 1, 1]}


def _shaped_stem(batch: int, channels: int, m: int, h: int, w: int, conv: dict[str, Any],
                 seed: int = 0) -> bytes:
    """A conv (channels -> m, ``conv``'s attributes, bias) + ReLU + a 3x3 stride-2 max
    pool + the pool's output doubled, on an h x w image."""
    rng = np.random.default_rng(seed)
    filters = (rng.standard_normal((m, channels, *conv["kernel_shape"])) * 0.1)
    bias = rng.standard_normal(m)
    nodes = [helper.make_node("Conv", ["x", "w", "b"], ["c"], **conv),
             helper.make_node("Relu", ["c"], ["r"]),
             helper.make_node("MaxPool", ["r"], ["p"], **_POOL3),
             helper.make_node("Add", ["p", "p"], ["y"])]
    graph = helper.make_graph(
        nodes, "stem", [helper.make_tensor_value_info("x", TensorProto.FLOAT,
                                                      [batch, channels, h, w])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
        [numpy_helper.from_array(filters.astype(np.float32), "w"),
         numpy_helper.from_array(bias.astype(np.float32), "b")])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]
                             ).SerializeToString()


_K3 = {"kernel_shape": [3, 3], "strides": [2, 2], "pads": [1, 1, 1, 1]}
_K7 = {"kernel_shape": [7, 7], "strides": [2, 2], "pads": [3, 3, 3, 3]}


@pytest.mark.parametrize(("why", "shape", "conv"), [
    # 12 conv columns a row: a 32-column panel spans three output rows (packed).
    ("a panel across more than two rows", (1, 3, 64, 1000, 23), _K7),
    ("a conv one column wide (pack_pairs' pairs)", (1, 3, 8, 18000, 2), _K3),
    ("a conv of row stride 1", (1, 1, 9, 240, 131),
     {"kernel_shape": [7, 7], "strides": [1, 2], "pads": [3, 3, 3, 3], "dilations": [3, 1]}),
    ("13 output channels (not a multiple of the tile's 8 rows)", (3, 3, 13, 451, 37), _K3),
    ("one output channel", (1, 3, 1, 200, 200), _K7),
    ("two conv columns a row", (1, 2, 20, 8400, 3), _K3),
])
def test_narrow_and_odd_convs_give_the_unfused_bits(
        why: str, shape: tuple[int, int, int, int, int], conv: dict[str, Any],
        monkeypatch: pytest.MonkeyPatch) -> None:
    batch, channels, m, h, w = shape
    onnx = _shaped_stem(batch, channels, m, h, w, conv)
    x = np.random.default_rng(5).standard_normal((batch, channels, h, w)).astype(np.float32)
    want = _bits(_load(onnx, 1, False, monkeypatch).predict({"x": x})["y"])
    for threads in (1, 2, 3, 16):
        model = _load(onnx, threads, True, monkeypatch)
        for _ in range(2):
            got = model.predict({"x": x})["y"]
        steps = _pool_steps(model)
        assert len(steps) == 1 and steps[0].fused is not None, (why, threads)
        assert np.array_equal(_bits(got), want), (why, threads)


def test_a_wide_image_s_phase_image_is_capped_to_the_l2_and_exact(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """An image wide enough that a step's 17 conv rows' phase image and the rows held
    outgrow the L2 the plan is sized for: fewer rows a phase image, explain() says so,
    and the bits are the unfused plan's. ResNet-18's stem keeps all 17."""
    l2 = cpu_planner.caches().l2
    # 8 channels x 17 rows x ow held, 48 bytes a phase column of 3 channels x 4 phases.
    ow = l2 // (8 * 17 * 4 + 48 * 20) + 64
    onnx = _shaped_stem(1, 3, 8, 72, 2 * ow, _K7)
    x = np.random.default_rng(6).standard_normal((1, 3, 72, 2 * ow)).astype(np.float32)
    want = _bits(_load(onnx, 1, False, monkeypatch).predict({"x": x})["y"])
    for threads in (1, 2):
        model = _load(onnx, threads, True, monkeypatch)
        for _ in range(2):
            got = model.predict({"x": x})["y"]
        text = str(model.explain())
        fills = {int(s.split("pool_in_conv: [")[1].split("]")[0].split(",")[2])
                 for s in text.splitlines() if "pool_in_conv: [" in s}
        (fill,) = fills                     # the conv's line and the pool's agree
        assert 1 <= fill < 17 and f"a phase image of {fill} of a step's 17 conv rows" in text
        assert f"the {l2 >> 10} KiB L2" in text
        assert _pool_steps(model)[0].fused is not None
        assert np.array_equal(_bits(got), want), threads
    stem = cpu_planner.conv_geometry(Op.CONV, [1, 3, 224, 224], [64, 3, 7, 7], _K7)
    # 476 KiB of rows held: all 17 from 1 MiB; 512 KiB leaves room for 3 rows' image
    # (6 phase rows of 5,520 bytes less the taps' reach of 3); below 476 KiB nothing
    # fits beside the rows and a cap would only gather the reach again: all 17.
    fills = {size: cpu_planner.pool_fill(stem, 17, size)
             for size in (2 << 20, 1 << 20, 512 << 10, 256 << 10)}
    assert fills == {2 << 20: 17, 1 << 20: 17, 512 << 10: 3, 256 << 10: 17}


def test_explain_states_the_fusion_and_its_split(monkeypatch: pytest.MonkeyPatch) -> None:
    model = _load(_stem(1), 16, True, monkeypatch)
    model.predict({"x": np.zeros((1, 3, 128, 128), np.float32)})
    text = model.explain()
    assert "pooled_by: MaxPool" in text
    assert "layout: pooled (pooled in the conv (planner.pool_in_conv)" in text
    assert "pool_in_conv: [16, 8, 17]" in text       # 16 bands; a step's 17 conv rows
    small = _load(_stem(1, size=100), 16, True, monkeypatch)   # 2,500 conv pixels
    assert "pool_in_conv" not in small.explain()
    off = _load(_stem(1), 16, False, monkeypatch)
    off.predict({"x": np.zeros((1, 3, 128, 128), np.float32)})
    assert "pool_in_conv" not in off.explain() and not _pool_steps(off)


def test_the_conv_s_threads_line_states_the_pooled_call_s_split(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The conv runs inside its pool's call: its threads line says that call's split (16
    pieces of images x bands), as the pool's does, not the split it would run alone."""
    text = str(_load(_stem(1), 16, True, monkeypatch).explain())
    conv = text[text.index("Conv_0 (conv on cpu):"):text.index("MaxPool_2 (max_pool on cpu):")]
    (threads,) = [line for line in conv.splitlines() if line.strip().startswith("threads:")]
    assert "one call (MaxPool_2's), 16 piece(s) of images x bands" in threads
    assert "phase copy" not in threads and "product" not in threads


def test_int8_precision_on_a_float_model_neither_plans_nor_runs_the_pooled_call(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """With precision="int8" the conv's filter is dequantized at run time (no constant
    for the pooled call to pack): the plan says nothing of pooling, and the steady run
    computes the conv's own output, as the plan says."""
    monkeypatch.setattr(cpu_planner, "POOL_IN_CONV", True)
    model = load_model(_stem(1), backend="cpu", threads=2, plan_cache=False,
                       precision="int8")
    x = np.random.default_rng(8).standard_normal((1, 3, 128, 128)).astype(np.float32)
    for _ in range(3):
        model.predict({"x": x})
    assert "pool_in_conv" not in str(model.explain()) and not _pool_steps(model)
    conv = _conv_output(model)
    conv.fill(-1.0)
    model.predict({"x": x})
    assert not (conv == -1.0).all()         # the conv wrote its output


@pytest.mark.parametrize(("why", "onnx"), [
    ("the conv's output is read elsewhere too", lambda: _stem(1, second_reader=True)),
    ("deeper than POOL_IN_CONV_MAX_DEPTH", lambda: _stem(1, channels=4)),
    ("a pool of stride 1 across", lambda: _stem(
        1, pool={"kernel_shape": [3, 3], "strides": [2, 1], "pads": [1, 1, 1, 1]})),
    ("a pool of four taps across", lambda: _stem(
        1, pool={"kernel_shape": [4, 4], "strides": [2, 2]})),
    # An initializer listed as a graph input too: the caller may feed another filter or
    # bias, which the pooled call (packing them once) would not see.
    ("a filter the caller may override", lambda: _stem(1, overridable=("w",))),
    ("a bias the caller may override", lambda: _stem(1, overridable=("b",))),
])
def test_the_rule_leaves_what_it_does_not_serve(why: str, onnx: Any,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    model = _load(onnx(), 2, True, monkeypatch)
    assert "pool_in_conv" not in model.explain(), why


def test_a_2x2_pool_is_served_and_exact(monkeypatch: pytest.MonkeyPatch) -> None:
    onnx = _stem(2, pool={"kernel_shape": [2, 2], "strides": [2, 2]})
    x = np.random.default_rng(2).standard_normal((2, 3, 128, 128)).astype(np.float32)
    want = _load(onnx, 1, False, monkeypatch).predict({"x": x})["y"]
    model = _load(onnx, 2, True, monkeypatch)
    for _ in range(2):
        got = model.predict({"x": x})["y"]
    assert _pool_steps(model) and np.array_equal(_bits(got), _bits(want))


def test_the_split_divides_images_x_bands_over_the_threads() -> None:
    def split(batch: int, rows: int, threads: int, kernel: int = 3, stride: int = 2
              ) -> native_gemm.PoolSplit:
        return cpu_planner.pool_in_conv_split(batch, rows, threads, kernel, stride)

    # 8 pooled rows a step of a 3-row stride-2 window read 17 conv rows: one phase image.
    assert split(1, 56, 1) == native_gemm.PoolSplit(1, 8, 17)
    assert split(1, 56, 2).bands == 2
    assert split(1, 56, 16).bands == 16
    assert split(32, 56, 16).bands == 1                 # whole images a thread
    assert split(3, 56, 2).bands == 2                   # 6 units over 2 threads
    assert split(1, 3, 16).bands == 3                   # no band without a pooled row
    assert split(1, 56, 1, kernel=2).fill == 16         # a 2x2 window reads 16 rows a step


def test_the_row_pool_refuses_rows_it_is_not_given() -> None:
    from keel.ops.schemas.conv import Window

    geo = native_window.plan(2, Window((8, 8), (3, 3), (2, 2), (1, 1), (1, 1), (1, 1),
                                       (4, 4)))
    assert geo is not None
    part = native_window._load().maxpool_part
    x = np.arange(2 * 8 * 8, dtype=np.float32).reshape(2, 8, 8)
    y = np.full((2, 4, 4), -1.0, np.float32)
    scratch = np.empty(1024, np.float32)
    args = (geo.address, scratch.ctypes.data, 2)
    # Output rows 1-2 read input rows 1-5; rows 2-7 held: refused, nothing written.
    assert part(x[:, 2:].copy().ctypes.data, 2, 6, 6, y.ctypes.data, *args, 1, 3) == -1
    # Rows 1-4 written in a buffer of 5 rows a plane: row 5 is not there, refused.
    held = x[:, 1:6].copy()
    assert part(held.ctypes.data, 1, 4, 5, y.ctypes.data, *args, 1, 3) == -1
    assert part(held.ctypes.data, 1, 5, 4, y.ctypes.data, *args, 1, 3) == -1  # stride < rows
    assert (y == -1.0).all()
    assert part(held.ctypes.data, 1, 5, 5, y.ctypes.data, *args, 1, 3) == 0
    want = np.full((2, 4, 4), -1.0, np.float32)
    for oy in (1, 2):
        for ox in range(4):
            want[:, oy, ox] = x[:, 2 * oy - 1:2 * oy + 2,
                                max(2 * ox - 1, 0):2 * ox + 2].max(axis=(1, 2))
    assert np.array_equal(y, want)


@pytest.mark.parametrize("size", [128, 150])
def test_a_run_keeping_every_value_computes_the_conv_s_own(
        size: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """After steady runs (the pool step waiting for its conv), intermediates() runs every
    step unbound: the conv writes its output and the pool reads it."""
    onnx = _stem(1, size=size)
    x = np.random.default_rng(3).standard_normal((1, 3, size, size)).astype(np.float32)
    want = _load(onnx, 1, False, monkeypatch).intermediates({"x": x})
    model = _load(onnx, 2, True, monkeypatch)
    for _ in range(3):
        model.predict({"x": x})
    assert _pool_steps(model)[0].fused is not None
    got = model.intermediates({"x": x})
    for name in ("r", "p", "y"):
        assert np.array_equal(_bits(got[name]), _bits(want[name])), name
    assert np.array_equal(_bits(model.predict({"x": x})["y"]), _bits(want["y"]))


@pytest.mark.parametrize("how", [{"hint": "throughput"}, {"memory_limit": "1MB"}])
def test_a_pooled_graph_output_given_to_the_caller_is_the_unfused_one(
        how: dict[str, Any], monkeypatch: pytest.MonkeyPatch) -> None:
    """The pool's output a small graph output (its step held) and the run writing into
    arrays the model gives (streams of a throughput hint, chunks of a memory limit): the
    held pool still runs the fused call the conv's step handed it."""
    rng = np.random.default_rng(0)
    w = (rng.standard_normal((2, 3, 7, 7)) * 0.1).astype(np.float32)
    b = rng.standard_normal(2).astype(np.float32)
    graph = helper.make_graph(
        [helper.make_node("Conv", ["x", "w", "b"], ["c"], kernel_shape=[7, 7],
                          strides=[2, 2], pads=[3, 3, 3, 3]),
         helper.make_node("Relu", ["c"], ["r"]),
         helper.make_node("MaxPool", ["r"], ["p"], kernel_shape=[2, 2], strides=[2, 2])],
        "stem", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 3, 131, 131])],
        [helper.make_tensor_value_info("p", TensorProto.FLOAT, None)],
        [numpy_helper.from_array(w, "w"), numpy_helper.from_array(b, "b")])
    onnx = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    blob = onnx.SerializeToString()
    x = rng.standard_normal((8, 3, 131, 131)).astype(np.float32)
    want = _bits(_load(blob, 2, False, monkeypatch).predict({"x": x})["p"])
    monkeypatch.setattr(cpu_planner, "POOL_IN_CONV", True)
    fused = load_model(blob, backend="cpu", threads=2, plan_cache=False, **how)
    for _ in range(3):
        assert np.array_equal(_bits(fused.predict({"x": x})["p"]), want)
    assert "pooled_by" in str(fused.explain()), "the plan did not pool in the conv"


def test_a_conv_whose_fused_activation_the_band_conv_lacks_is_not_pooled(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A fused LeakyRelu (no band conv epilogue): the plan keeps conv and pool apart, as
    the run does, and says nothing of pooling."""
    model = onnx_lib.load_from_string(_stem(1))
    for node in model.graph.node:
        if node.op_type == "Relu":
            node.op_type = "LeakyRelu"
            node.attribute.append(helper.make_attribute("alpha", 0.1))
    blob = model.SerializeToString()
    fused = _load(blob, 2, True, monkeypatch)
    assert "pool_in_conv" not in str(fused.explain())
    x = np.random.default_rng(2).standard_normal((1, 3, 128, 128)).astype(np.float32)
    want = _bits(_load(blob, 2, False, monkeypatch).predict({"x": x})["y"])
    assert np.array_equal(_bits(fused.predict({"x": x})["y"]), want)


@pytest.mark.parametrize("threads", [1, 2])
def test_a_pool_refusing_its_rows_raises(threads: int) -> None:
    """gemm.c's keel_conv_pool_f32 reports a pool that refused the conv rows it was handed
    (its window and the rows held disagree; prepare_pooled never makes such a call): a
    typed error, on one thread and split."""
    from keel.errors import ExecutionError
    from keel.ops.schemas.conv import Window

    rng = np.random.default_rng(4)
    x = rng.standard_normal((1, 3, 32, 32)).astype(np.float32)
    packed = native_gemm.pack(rng.standard_normal((16, 3 * 3 * 3)).astype(np.float32), True)
    assert packed is not None
    conv = np.empty((1, 16, 16, 16), np.float32)
    band = native_gemm.prepare_band(x, packed, conv, (3, 3), (2, 2), (1, 1), (1, 1))
    geo = native_window.plan(16, Window((16, 16), (3, 3), (2, 2), (1, 1), (1, 1), (1, 1),
                                        (8, 8)))
    pool = native_window.row_pool(geo) if geo is not None else None
    assert band is not None and geo is not None and pool is not None
    y = np.full((1, 16, 8, 8), 7.0, np.float32)
    split = native_gemm.PoolSplit(2, 2, 4)

    def call(kh: int) -> Any:
        rows = native_gemm.RowPool(pool[0], geo.address, pool[1], kh, 2, 1, geo)
        prepared = native_gemm.prepare_pooled(band, y, rows, split)
        assert prepared is not None
        return prepared.bound(threads)

    with pytest.raises(ExecutionError, match="refused the conv rows"):
        call(2)()                           # the buffer holds 2-row windows: too few rows
    call(3)()                               # the window's own rows: served
    assert not (y == 7.0).any()


def test_a_pool_reading_a_conv_row_not_computed_in_its_call_is_refused() -> None:
    """The pool's window reads a conv row the call did not compute, though the buffer has
    room for it (a 2-row window held where the geometry's is 3 rows, one pooled row): the
    call is refused, where it pooled the row an earlier call left in the buffer."""
    from keel.errors import ExecutionError
    from keel.ops.schemas.conv import Window

    rng = np.random.default_rng(4)
    x = np.empty((1, 3, 4, 4), np.float32)
    packed = native_gemm.pack(rng.standard_normal((16, 27)).astype(np.float32), True)
    conv = np.empty((1, 16, 2, 2), np.float32)
    assert packed is not None
    band = native_gemm.prepare_band(x, packed, conv, (3, 3), (2, 2), (1, 1), (1, 1))
    geo = native_window.plan(16, Window((2, 2), (3, 3), (2, 2), (1, 1), (1, 1), (1, 1),
                                        (1, 1)))
    pool = native_window.row_pool(geo) if geo is not None else None
    assert band is not None and geo is not None and pool is not None

    def run(kh: int) -> np.ndarray:
        y = np.full((1, 16, 1, 1), 7.0, np.float32)
        rows = native_gemm.RowPool(pool[0], geo.address, pool[1], kh, 2, 1, geo)
        prepared = native_gemm.prepare_pooled(band, y, rows, native_gemm.PoolSplit(1, 1, 4))
        assert prepared is not None
        prepared.bound(1)()
        return y

    x[:] = 100.0 + rng.random(x.shape, dtype=np.float32)
    run(3)                                  # leaves both conv rows in the buffer
    x[:] = rng.standard_normal(x.shape).astype(np.float32) * 0.01
    with pytest.raises(ExecutionError, match="refused the conv rows"):
        run(2)                              # computes conv row 0 only; the window reads 1


def _conv_output(model: Any) -> np.ndarray:
    """The conv's output array (the arena view its pool reads), which a fused run never
    writes."""
    program = next(p.program for p in model._cache.values() if p.program is not None)
    pool = next(st for st in program._steps if st.op == "max_pool")
    return program._values[pool.inputs[0]]


def test_a_pool_stays_paired_with_its_conv_while_others_bind(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Another program binding its pooled conv on many threads after this one (more
    pairings than any memo kept) leaves this one's conv (unbound: it reads a large feed
    where the caller has it, as a network's first conv does) handing over to its pool:
    its output still never written."""
    size = 150
    x = np.random.default_rng(5).standard_normal((1, 3, size, size)).astype(np.float32)
    model = _load(_stem(1, size=size), 1, True, monkeypatch)
    want = _bits(_load(_stem(1, size=size), 1, False, monkeypatch).predict({"x": x})["y"])
    for _ in range(3):
        model.predict({"x": x})
    other = _load(_stem(1, seed=7), 1, True, monkeypatch)
    small = x[..., :128, :128].copy()
    other.predict({"x": small})
    done, bound, turn = threading.Event(), threading.Semaphore(0), threading.Lock()

    def bind_and_stay() -> None:            # binds the other's steps anew on its thread
        with turn:
            other.predict({"x": small})
        bound.release()
        done.wait()

    threads = [threading.Thread(target=bind_and_stay) for _ in range(65)]
    for thread in threads:                  # all alive at once: 65 distinct threads
        thread.start()
    for _ in threads:
        bound.acquire()
    done.set()
    for thread in threads:
        thread.join()
    conv = _conv_output(model)
    conv.fill(-1.0)                         # a value no conv + ReLU writes
    assert np.array_equal(_bits(model.predict({"x": x})["y"]), want)
    assert (conv == -1.0).all(), "the conv computed its own output: the pairing was lost"


def test_a_run_cut_short_between_conv_and_pool_leaves_nothing_handed(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The conv's step handed X over and the run stopped before the pool's step; the next
    run's conv computes its own output (its X of an array type the fused call does not
    take): the pool then runs its own call, not the fused one on the earlier X."""
    onnx = _stem(1, size=150)               # a feed read where the caller has it
    rng = np.random.default_rng(6)
    x = rng.standard_normal((1, 3, 150, 150)).astype(np.float32)
    model = _load(onnx, 1, True, monkeypatch)
    for _ in range(3):
        model.predict({"x": x})
    conv = _conv_output(model)
    assert conv_pool.hand_over(x, conv, lambda: None)   # as the conv's step does; then cut
    other = (x + 1.0).view(_Array)
    want = _bits(_load(onnx, 1, False, monkeypatch).predict({"x": other})["y"])
    assert np.array_equal(_bits(model.predict({"x": other})["y"]), want)


class _Array(np.ndarray):
    """An ndarray subclass: a feed the fused call does not take as it is."""
