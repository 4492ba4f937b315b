"""Float NCHWc regions: 3x3 stride-1 convs whose values stay channel-blocked
([N][C/16][H][W][16]) between them (the cpu planner's float_layouts). Each conv's plan
names its layout with the reason, a value leaves the region where something other than a
blocked conv reads it or it is a graph output, narrow or ragged channels decline; results
are the same bits on 1, 2, 3 and 16 threads and as the plan without the region, and match
the reference backend and onnxruntime."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

import keel
from keel.backends.cpu import native_blocked, planner
from keel.hardware.fakes import fake_profile
from keel.ops.registry import Op
from keel.ops.schemas.conv import conv_geometry

ort = pytest.importorskip("onnxruntime")
onnx = pytest.importorskip("onnx")
from onnx import TensorProto, helper, numpy_helper  # noqa: E402


@pytest.fixture(autouse=True)
def _blocked_here(request: pytest.FixtureRequest) -> None:
    if "stated" in request.fixturenames:
        return                  # planned for a stated profile: runs on every machine
    geo = conv_geometry(Op.CONV, (1, 16, 16, 16), (16, 16, 3, 3), {"pads": (1, 1, 1, 1)})
    if not native_blocked.available() or not planner.blocked_conv(geo):
        pytest.skip("the blocked conv is planned on AVX-512 Intel cores only")


class _Graph:
    """A float model of 3x3 convs (padded by one, with a bias), named by what they read."""

    def __init__(self, channels: int, size: int) -> None:
        self.rng = np.random.default_rng(3)
        self.channels = self.inputs = channels
        self.size = size
        self.nodes: list[Any] = []
        self.weights: list[Any] = []
        self.outputs: list[str] = []

    def conv(self, name: str, x: str, relu: bool = True, residual: str = "",
             in_channels: int = 0, strides: tuple[int, int] | list[int] = (1, 1),
             kernel: int = 3) -> str:
        c, m = in_channels or self.channels, self.channels
        w = (self.rng.standard_normal((m, c, kernel, kernel))
             * np.sqrt(2 / (kernel * kernel * c))).astype(np.float32)
        b = (0.1 * self.rng.standard_normal(m)).astype(np.float32)
        self.weights += [numpy_helper.from_array(w, f"{name}_w"),
                         numpy_helper.from_array(b, f"{name}_b")]
        out = f"{name}_conv"
        pad = kernel // 2
        self.nodes.append(helper.make_node("Conv", [x, f"{name}_w", f"{name}_b"], [out],
                                           name=name, pads=[pad] * 4,
                                           kernel_shape=[kernel, kernel],
                                           strides=list(strides)))
        if residual:
            self.nodes.append(helper.make_node("Add", [out, residual], [f"{name}_add"]))
            out = f"{name}_add"
        if relu:
            self.nodes.append(helper.make_node("Relu", [out], [f"{name}_y"]))
            out = f"{name}_y"
        return out

    def down(self, name: str, x: str) -> str:
        """A downsampling block to twice the channels at half the size: a stride-2 3x3 conv
        and a 3x3 conv, added to a stride-2 1x1 shortcut of ``x``, then ReLU."""
        c = self.channels
        self.channels = 2 * c
        inner = self.conv(f"{name}a", x, in_channels=c, strides=[2, 2])
        main = self.conv(f"{name}b", inner, relu=False)
        shortcut = self.conv(f"{name}s", x, relu=False, in_channels=c, strides=[2, 2],
                             kernel=1)
        added = f"{name}_sum"
        self.nodes.append(helper.make_node("Add", [main, shortcut], [added]))
        return self.node("Relu", added)

    def node(self, op: str, x: str, **attrs: Any) -> str:
        out = f"{op.lower()}_{len(self.nodes)}"
        self.nodes.append(helper.make_node(op, [x], [out], **attrs))
        return out

    def model(self, last: str) -> bytes:
        shape = ["N", self.inputs, self.size, self.size]
        outputs = [helper.make_tensor_value_info(o, TensorProto.FLOAT, None)
                   for o in [*self.outputs, last]]
        graph = helper.make_graph(self.nodes, "nchwc",
                                  [helper.make_tensor_value_info("x", TensorProto.FLOAT,
                                                                 shape)],
                                  outputs, self.weights)
        proto = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
        proto.ir_version = 8
        return bytes(proto.SerializeToString())


def _blocks(channels: int = 32, size: int = 16) -> tuple[bytes, str]:
    """Two basic blocks (identity residuals) and a global average pool."""
    g = _Graph(channels, size)
    a = g.conv("c1", "x")
    b = g.conv("c2", g.conv("c2a", a), residual=a)
    c = g.conv("c3", g.conv("c3a", b), residual=b)
    return g.model(g.node("GlobalAveragePool", c)), "region"


def _broken() -> bytes:
    """A max pool between two pairs of convs: two regions."""
    g = _Graph(16, 16)
    a = g.conv("c2", g.conv("c1", "x"))
    pooled = g.node("MaxPool", a, kernel_shape=[3, 3], pads=[1, 1, 1, 1])
    return g.model(g.conv("c4", g.conv("c3", pooled), residual=pooled))


def _output_inside() -> bytes:
    """c2's result is a graph output as well as c3's input."""
    g = _Graph(16, 16)
    a = g.conv("c2", g.conv("c1", "x"))
    g.outputs.append(a)
    return g.model(g.conv("c4", g.conv("c3", a)))


def _residual_only() -> bytes:
    """c1's result is c2's X and c3's residual; c3 reads a max pool of the input and
    writes a graph output, as does c2."""
    g = _Graph(16, 16)
    a = g.conv("c1", "x")
    g.outputs.append(g.conv("c2", a))
    pooled = g.node("MaxPool", "x", kernel_shape=[3, 3], pads=[1, 1, 1, 1])
    return g.model(g.conv("c3", pooled, residual=a))


def _layouts(model: Any) -> dict[str, str]:
    return {p.name: p.layout for p in model.plan.nodes if p.op == "conv"}


@pytest.fixture
def stated() -> Any:
    """The profile the declining tests plan for: an Intel AVX-512 server's, where a
    region would be planned but for what the test changes (where blocked.c loads: the
    region needs this machine's library whatever profile is stated)."""
    if not native_blocked.available():
        pytest.skip("blocked.c is not loaded here: no plan gets a region to decline")
    return fake_profile("x86-avx512-server")


def _load(blob: bytes, threads: int = 1, hardware: Any = None) -> Any:
    return keel.load_model(blob, backend="cpu", threads=threads, plan_cache=False,
                           hardware=hardware)


def _feeds(blob: bytes, batch: int = 2) -> dict[str, np.ndarray]:
    value = onnx.load_from_string(blob).graph.input[0]
    size = [batch, *(d.dim_value for d in value.type.tensor_type.shape.dim[1:])]
    return {value.name: np.random.default_rng(5).standard_normal(size).astype(np.float32)}


def _check_results(blob: bytes, batch: int = 2, intermediates: bool = True) -> None:
    """Bitwise the same on 1, 2, 3 and 16 threads; onnxruntime's and (``intermediates``)
    the reference backend's every value to tolerance, blocked ones given back in NCHW."""
    feeds = _feeds(blob, batch)
    runs = [_load(blob, t).predict(feeds) for t in (1, 2, 3, 16)]
    for run in runs[1:]:
        for name, value in run.items():
            assert np.array_equal(np.asarray(value), np.asarray(runs[0][name])), name
    sess = ort.InferenceSession(blob, providers=["CPUExecutionProvider"])
    names = [o.name for o in sess.get_outputs()]
    for name, want in zip(names, sess.run(None, feeds), strict=True):
        np.testing.assert_allclose(np.asarray(runs[0][name]), want, rtol=1e-4, atol=1e-4)
    if not intermediates:
        return
    reference = keel.load_model(blob, backend="reference").intermediates(feeds)
    for name, value in _load(blob, 2).intermediates(feeds).items():
        if name in reference:
            np.testing.assert_allclose(value, reference[name], rtol=1e-4, atol=1e-4,
                                       err_msg=name)


def test_a_region_of_two_blocks() -> None:
    blob, _ = _blocks()
    model = _load(blob, 2)
    model.predict(_feeds(blob))
    layouts = _layouts(model)
    assert list(layouts.values()) == ["nchw->nchwc16", *["nchwc16->nchwc16"] * 3,
                                      "nchwc16->nchw"]
    plans = {p.name: p.plan for p in model.plan.nodes if p.op == "conv"}
    first = plans["c1"]
    assert first is not None and "float NCHWc region of 5" in first.reason("layout")
    assert "starts it" in first.reason("layout")
    last = plans["c3"]
    assert last is not None and "GlobalAveragePool" in last.reason("layout")
    assert last.option("residual_layout") == "nchwc16"
    assert "channel-blocked" in last.reason("threads")
    assert "nchwc16->nchwc16" in str(model.explain())
    # the blocked kernel's variant and scratch, not the NCHW form's it replaced: one
    # register tile's sums (2 blocks of 16 channels x 16 pixels) on each of 2 threads
    assert "blocked.c" in first.reason("variant")
    assert first.workspace_bytes == 2 * 4 * (2 * 16 * 1 * 16)
    assert "2 thread(s)" in first.reason("workspace_bytes")
    _check_results(blob)


@pytest.mark.parametrize(("size", "rows", "why"), [
    (8, 2, "8-pixel rows are 8 past whole 16-pixel transposes and pair up"),
    (16, 1, "a 16-pixel row is whole 16-pixel transposes already")])
def test_the_plan_gives_the_blocked_convs_rows_a_unit(size: int, rows: int, why: str
                                                      ) -> None:
    """The planner's blocked_rows: 8-pixel rows pair into whole 16-pixel transposes, 16-pixel
    rows are whole ones already; the variant's reason says which, the scratch counts them
    and the kernel runs what the plan says."""
    blob, _ = _blocks(32, size)
    model = _load(blob, 1)
    model.predict(_feeds(blob))
    first = {p.name: p.plan for p in model.plan.nodes if p.op == "conv"}["c1"]
    assert first is not None and "blocked.c" in first.reason("variant")
    assert f"{rows} output row" in first.reason("variant")
    assert f"blocked_rows: {why}" in first.reason("variant")
    assert "lane masks" not in first.reason("variant")
    assert first.workspace_bytes == 4 * (2 * 16 * rows * size)
    _check_results(blob, intermediates=False)


def test_one_image_of_few_bands_splits_its_output_channels_too() -> None:
    """64 channels on 8 x 8 at batch 1 are 4 bands of two rows: on 16 threads each
    conv's two register tiles of output channels are split units too (8 chunks, where
    bands alone gave 4), the same bits on 1, 2, 3 and 16 threads."""
    blob, _ = _blocks(channels=64, size=8)
    model = _load(blob, 16)
    model.predict(_feeds(blob, 1))
    plans = [p.plan for p in model.plan.nodes if p.op == "conv"]
    assert plans and all(p is not None and p.layout in native_blocked.REGION_LAYOUTS
                         for p in plans)
    for plan in plans:
        assert plan is not None
        assert "4 band(s) of output rows x 2 group(s) of 1 register tile(s)" in plan.reason(
            "threads")
        assert "split into 8 piece(s)" in plan.reason("threads")
    _check_results(blob, batch=1, intermediates=False)


def test_the_same_bits_as_the_plan_without_the_region(monkeypatch: pytest.MonkeyPatch
                                                      ) -> None:
    """The blocked tiles sum each element in the masked form's order: the region changes
    the layout, not the values."""
    blob, _ = _blocks(channels=16, size=32)
    feeds = _feeds(blob, 3)
    region = _load(blob, 2)
    got = region.predict(feeds)
    assert "nchwc16->nchwc16" in _layouts(region).values()
    monkeypatch.setattr(planner, "BLOCKED_VENDORS", frozenset())
    plain = _load(blob, 2)
    want = plain.predict(feeds)
    assert not any("nchwc16" in v for v in _layouts(plain).values())
    for name, value in want.items():
        assert np.array_equal(np.asarray(got[name]), np.asarray(value))


def test_a_max_pool_breaks_the_region() -> None:
    blob = _broken()
    model = _load(blob, 2)
    model.predict(_feeds(blob))
    assert _layouts(model) == {"c1": "nchw->nchwc16", "c2": "nchwc16->nchw",
                               "c3": "nchw->nchwc16", "c4": "nchwc16->nchw"}
    c2 = next(p.plan for p in model.plan.nodes if p.name == "c2")
    assert c2 is not None and "MaxPool" in c2.reason("layout")
    c4 = next(p.plan for p in model.plan.nodes if p.name == "c4")
    assert c4 is not None and c4.option("residual_layout") == "nchw"
    _check_results(blob)


def test_a_graph_output_inside_a_chain_is_written_nchw() -> None:
    blob = _output_inside()
    model = _load(blob, 2)
    model.predict(_feeds(blob))
    layouts = _layouts(model)
    assert layouts["c1"] == "nchw->nchwc16" and layouts["c2"] == "nchwc16->nchw"
    assert layouts["c3"] == "nchw->nchwc16" and layouts["c4"] == "nchwc16->nchw"
    c2 = next(p.plan for p in model.plan.nodes if p.name == "c2")
    assert c2 is not None and "graph output" in c2.reason("layout")
    _check_results(blob)


def test_a_conv_reading_only_its_residual_blocked() -> None:
    blob = _residual_only()
    model = _load(blob, 2)
    model.predict(_feeds(blob))
    assert _layouts(model) == {"c1": "nchw->nchwc16", "c2": "nchwc16->nchw",
                               "c3": "nchw->nchw"}
    c3 = next(p.plan for p in model.plan.nodes if p.name == "c3")
    assert c3 is not None and c3.option("residual_layout") == "nchwc16"
    assert "reads only its residual blocked" in c3.reason("layout")
    assert "bands of output rows" in c3.reason("threads")
    _check_results(blob)


@pytest.mark.parametrize("threads", [1, 2])
def test_an_empty_batch_runs_through_a_region(threads: int) -> None:
    blob, _ = _blocks()
    model = _load(blob, threads)
    out = model.predict(_feeds(blob, 0))
    assert "nchwc16->nchwc16" in _layouts(model).values()
    (value,) = out.values()
    assert np.asarray(value).shape == (0, 32, 1, 1)
    _check_results(blob, 3)                 # and a batch after it


def test_no_region_where_the_blocked_kernel_is_not_loaded(monkeypatch: pytest.MonkeyPatch,
                                                          stated: Any) -> None:
    """Without blocked.c (a build that failed, or not for AVX-512) the planner keeps the
    NCHW forms rather than planning a region its kernel cannot run."""
    blob, _ = _blocks()
    monkeypatch.setattr(native_blocked, "_functions", lambda: None)
    planner.forget()
    assert not any("nchwc16" in v for v in _layouts(_load(blob, 2, stated)).values())
    model = _load(blob, 2)
    feeds = _feeds(blob)
    sess = ort.InferenceSession(blob, providers=["CPUExecutionProvider"])
    (want,) = sess.run(None, feeds)
    (got,) = model.predict(feeds).values()
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("channels", [8, 24])
def test_channels_not_a_multiple_of_16_decline(channels: int, stated: Any) -> None:
    blob, _ = _blocks(channels=channels)
    assert not any("nchwc16" in v for v in _layouts(_load(blob, 2, stated)).values())
    _check_results(blob)


def test_pointwise_stride_1_convs_stay_out_of_a_region() -> None:
    """1x1 stride-1 convs between 3x3 ones (as in a bottleneck) keep their NCHW forms:
    blocked they ran slower, so the 3x3 convs on either side are regions of their own."""
    g = _Graph(32, 16)
    a = g.conv("c1", g.conv("c0", "x"))
    b = g.conv("p2", g.conv("p1", a, kernel=1), kernel=1)
    blob = g.model(g.conv("c4", g.conv("c3", b)))
    layouts = _layouts(_load(blob))
    assert not any("nchwc16" in layouts[name] for name in ("p1", "p2"))
    assert layouts["c0"] == "nchw->nchwc16" and layouts["c4"] == "nchwc16->nchw"
    _check_results(blob, intermediates=False)


def test_a_downsampling_block_joins_the_region() -> None:
    """A stride-2 3x3 conv, the 1x1 stride-2 shortcut (moved beside it: both read the
    block's input) and the block's second conv (the Add and ReLU fused into it, the
    shortcut's result its blocked residual) run blocked between two stride-1 blocks: one
    region, every value the reference's."""
    g = _Graph(16, 16)
    a = g.conv("c1", "x")
    b = g.down("d", g.conv("c2", a, residual=a))
    blob = g.model(g.conv("c4", g.conv("c3", b), residual=b))
    model = _load(blob, 2)
    model.predict(_feeds(blob))
    layouts = _layouts(model)
    assert layouts["c1"] == "nchw->nchwc16" and layouts["c4"] == "nchwc16->nchw"
    assert all(layouts[n] == "nchwc16->nchwc16" for n in ("c2", "da", "db", "ds", "c3"))
    assert [p.name for p in model.plan.nodes if p.name.startswith("d")] == ["da", "ds", "db"]
    second = next(p.plan for p in model.plan.nodes if p.name == "db")
    assert second is not None and second.option("residual_layout") == "nchwc16"
    assert "region of 7 conv(s)" in second.reason("layout")
    _check_results(blob)


def test_resnet20_is_one_region_from_its_first_blockable_conv() -> None:
    """ResNet-20 (benchmarks' model): every conv after the 3 -> 16 stem, the stride-2 3x3
    and 1x1 shortcut convs (the shortcut moved beside the stride-2 conv, the block's Add
    fused into its second conv, which reads the shortcut's result blocked as the residual)
    included, is one region; the conv before the global average pool ends it."""
    zoo = pytest.importorskip("benchmarks.zoo")
    blob = zoo.resnet20().SerializeToString()
    model = _load(blob, 2)
    model.predict(_feeds(blob, 1))
    layouts = _layouts(model)
    assert list(layouts.values()) == ["masked", "nchw->nchwc16", *["nchwc16->nchwc16"] * 18,
                                      "nchwc16->nchw"]
    plans = {p.name: p.plan for p in model.plan.nodes if p.op == "conv"}
    second = plans["Conv_178"]          # the block's second 3x3, its Add and ReLU fused
    assert second is not None and second.option("residual_layout") == "nchwc16"
    assert "float NCHWc region of 20 conv(s)" in second.reason("layout")
    last = plans["Conv_235"]
    assert last is not None and "GlobalAveragePool" in last.reason("layout")
    _check_results(blob, 2, intermediates=False)


def test_a_lone_stride_2_conv_runs_blocked_alone() -> None:
    """A 3x3 stride-2 conv between two pools (no region can hold it) runs blocked alone,
    X and Y NCHW, where its output rows are 14 pixels or more (28 and 14 here); at 7 (a
    tail tile only, measured no faster) it keeps its NCHW form. Every value the
    reference's."""
    g = _Graph(16, 56)
    wide = g.conv("w", g.node("MaxPool", "x", kernel_shape=[1, 1]), strides=[2, 2])
    g.channels = 32
    middle = g.conv("m", g.node("MaxPool", wide, kernel_shape=[1, 1]), in_channels=16,
                    strides=[2, 2])
    narrow = g.conv("n", g.node("MaxPool", middle, kernel_shape=[1, 1]), strides=[2, 2])
    blob = g.model(g.node("MaxPool", narrow, kernel_shape=[1, 1]))
    model = _load(blob, 2)
    model.predict(_feeds(blob))
    layouts = _layouts(model)
    assert layouts["w"] == layouts["m"] == "nchw->nchw" and "nchw" not in layouts["n"]
    for name, width in (("w", 28), ("m", 14)):
        plan = next(p.plan for p in model.plan.nodes if p.name == name)
        assert plan is not None and "channel-blocked alone" in plan.reason("layout")
        assert f"{width}-pixel output rows" in plan.reason("layout")
    _check_results(blob)


def test_a_one_block_conv_keeps_sixteen_pixel_rows_alone() -> None:
    """14-pixel rows run blocked alone only where the register tile holds two blocks of
    output channels (the width measured with a two-block tail): 16 output channels (one
    block) on 14-pixel rows keep their NCHW form, 32 run blocked."""
    for channels, blocked in ((16, False), (32, True)):
        g = _Graph(16, 28)
        g.channels = channels
        conv = g.conv("m", g.node("MaxPool", "x", kernel_shape=[1, 1]), in_channels=16,
                      strides=[2, 2])
        blob = g.model(g.node("MaxPool", conv, kernel_shape=[1, 1]))
        model = _load(blob, 2)
        model.predict(_feeds(blob))
        assert (_layouts(model)["m"] == "nchw->nchw") is blocked
        _check_results(blob)


def test_a_batch_on_many_threads_runs_seven_pixel_rows_blocked_alone() -> None:
    """A batch's 3x3 stride-2 conv with 7-pixel output rows whose product splits over
    BLOCKED_ALONE_MANY_THREADS threads or more runs blocked alone too (measured on 16
    cores); on fewer threads, one image, or a conv too small to split that far on a
    16-thread cap, it keeps its NCHW form. Bitwise the same on 1, 2, 3 and 16 threads."""
    many = planner.BLOCKED_ALONE_MANY_THREADS
    pads = {"strides": (2, 2), "pads": (1, 1, 1, 1)}
    geo = conv_geometry(Op.CONV, (4, 128, 14, 14), (128, 128, 3, 3), pads)
    assert planner.batch_on_many_threads(geo, many, many)       # 58 Mflops: every thread
    assert planner.blocked_alone(geo, many)
    assert not planner.blocked_alone(geo, many - 1)
    one = conv_geometry(Op.CONV, (1, 128, 14, 14), (128, 128, 3, 3), pads)
    assert not planner.blocked_alone(one, many)
    small = conv_geometry(Op.CONV, (2, 8, 14, 14), (8, 8, 3, 3), pads)
    assert not planner.batch_on_many_threads(small, many, many)
    assert not planner.blocked_alone(small, many)
    g = _Graph(128, 14)
    narrow = g.conv("n", g.node("MaxPool", "x", kernel_shape=[1, 1]), strides=[2, 2])
    blob = g.model(g.node("MaxPool", narrow, kernel_shape=[1, 1]))
    for threads, blocked in ((2, False), (many, True)):
        model = _load(blob, threads)
        model.predict(_feeds(blob, 4))
        assert (_layouts(model)["n"] == "nchw->nchw") is blocked
        plan = next(p.plan for p in model.plan.nodes if p.name == "n")
        assert plan is not None
        assert ("BLOCKED_ALONE_MANY_THREADS" in plan.reason("layout")) is blocked
    _check_results(blob, batch=4)


def test_a_region_on_rows_that_are_not_whole_tiles() -> None:
    """Rows of 14 pixels (a tile of 8 and a tail of 6, bands' last runs through lane
    masks): a region of stride-1 convs, bitwise the same on every thread count."""
    g = _Graph(32, 14)
    a = g.conv("c1", "x")
    blob = g.model(g.conv("c3", g.conv("c2", a), residual=a))
    model = _load(blob, 2)
    model.predict(_feeds(blob))
    layouts = _layouts(model)
    assert layouts["c1"] == "nchw->nchwc16" and layouts["c3"] == "nchwc16->nchw"
    _check_results(blob)
