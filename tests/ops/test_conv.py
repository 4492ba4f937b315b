"""The conv family: seed-001 conv2d, window geometry, reference vs ONNX, every cpu
variant vs the reference, the fused epilogue, Winograd and the workspace cache."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from keel.backends.cpu import conv as cpu_conv
from keel.backends.cpu import conv_gemm, depthwise, winograd, workspace
from keel.backends.cpu import planner as cpu_planner
from keel.backends.cpu.conv_rules import ConvCase, conv_case, pick
from keel.dtypes import DType
from keel.errors import InvalidArgumentError, UnsupportedOperationError
from keel.ops.registry import Op
from keel.ops.schema import get_schema
from keel.ops.schemas.conv import conv_geometry, window, window_out_dim
from keel.ops.types import TensorType
from tests.ops._matconv_support import CPU_CTX, cpu, onnx_reference, onnxruntime_node, ref

RNG = np.random.default_rng(11)
P1 = (1, 1, 1, 1)


def _f(*shape: int, dtype: Any = np.float32) -> np.ndarray:
    return RNG.standard_normal(shape).astype(dtype)


# ---- seed 001 -----------------------------------------------------------------------------
def test_seed_conv2d_by_hand() -> None:
    x = np.arange(16, dtype=np.float32).reshape(1, 1, 4, 4)
    w = np.ones((1, 1, 2, 2), np.float32)
    want = np.array([[10, 14, 18], [26, 30, 34], [42, 46, 50]], np.float32)
    for kernel in (ref, cpu):
        (y,) = kernel(Op.CONV2D, [x, w])
        assert y.shape == (1, 1, 3, 3)
        np.testing.assert_array_equal(y[0, 0], want)


def test_seed_conv2d_attributes_match_conv() -> None:
    x, w = _f(2, 4, 9, 8), _f(6, 2, 3, 3)
    (y,) = cpu(Op.CONV2D, [x, w], stride=2, padding=(1, 2), dilation=1, groups=2)
    (want,) = ref(Op.CONV, [x, w], strides=(2, 2), pads=(1, 2, 1, 2), group=2)
    np.testing.assert_allclose(y, want, rtol=1e-5, atol=1e-5)
    with pytest.raises(InvalidArgumentError, match="padding must be one int"):
        cpu(Op.CONV2D, [x, w], padding=(1, 2, 3))


# ---- geometry ---------------------------------------------------------------------------------
def test_window_output_sizes() -> None:
    assert window_out_dim(56, 3, 1, 1, 1, 1, "NOTSET") == 56
    assert window_out_dim(224, 7, 2, 1, 3, 3, "NOTSET") == 112
    assert window_out_dim(8, 3, 2, 1, 0, 0, "NOTSET", ceil_mode=True) == 4
    assert window_out_dim(7, 3, 2, 1, 0, 0, "SAME_UPPER") == 4
    assert window_out_dim("h", 3, 1, 1, 1, 1, "NOTSET") is None


def test_same_padding_puts_the_odd_pad_where_asked() -> None:
    upper = window(Op.CONV, (8,), (4,), {"auto_pad": "SAME_UPPER", "strides": (2,)})
    lower = window(Op.CONV, (8,), (4,), {"auto_pad": "SAME_LOWER", "strides": (2,)})
    assert (upper.pads_begin, upper.pads_end, upper.out_spatial) == ((1,), (1,), (4,))
    upper = window(Op.CONV, (7,), (4,), {"auto_pad": "SAME_UPPER", "strides": (2,)})
    lower = window(Op.CONV, (7,), (4,), {"auto_pad": "SAME_LOWER", "strides": (2,)})
    assert (upper.pads_begin, upper.pads_end) == ((1,), (2,))
    assert (lower.pads_begin, lower.pads_end) == ((2,), (1,))


@pytest.mark.parametrize(("x", "w", "attrs", "message"), [
    ((1, 3, 5, 5), (4, 2, 3, 3), {}, "X has 3 channels but W expects 2 per group"),
    ((1, 4, 5, 5), (3, 2, 3, 3), {"group": 2}, "do not split into 2 groups"),
    ((1, 3, 2, 2), (4, 3, 3, 3), {}, "does not fit the padded input"),
    ((1, 3, 5, 5), (4, 3, 3, 3), {"pads": (1, 1)}, "pads needs 4 values"),
    ((1, 3, 5, 5), (4, 3, 3, 3), {"strides": (0, 1)}, "strides must be >= 1"),
    ((1, 3, 5, 5), (4, 3, 3, 3), {"auto_pad": "SAME"}, "auto_pad must be one of"),
    ((3, 5, 5), (4, 3, 3, 3), {}, "W must have X's rank"),
    ((1, 3, 5, 5), (4, 3, 3, 3), {"kernel_shape": (2, 2)}, "does not match W's spatial"),
])
def test_conv_shape_errors(x: tuple[int, ...], w: tuple[int, ...], attrs: dict[str, Any],
                           message: str) -> None:
    with pytest.raises(InvalidArgumentError, match=message):
        conv_geometry(Op.CONV, x, w, attrs)


def test_conv_infer_with_symbolic_dims() -> None:
    schema = get_schema(Op.CONV)
    f32 = DType.FLOAT32
    out = schema.infer_types([TensorType(f32, ("n", 3, 224, 224)), TensorType(f32, (64, 3, 7, 7))],
                             schema.normalize_attrs({"pads": (3, 3, 3, 3), "strides": (2, 2)}))
    assert out == [TensorType(f32, ("n", 64, 112, 112))]
    out = schema.infer_types([TensorType(f32, (1, 3, "h", 8)), TensorType(f32, (4, 3, 3, 3))],
                             schema.normalize_attrs({}))
    assert out == [TensorType(f32, (1, 4, None, 6))]
    with pytest.raises(InvalidArgumentError, match=r"Z \(residual\) must have Y's shape"):
        schema.infer_types([TensorType(f32, (1, 3, 5, 5)), TensorType(f32, (4, 3, 3, 3)),
                            None, TensorType(f32, (1, 4, 5, 5))], schema.normalize_attrs({}))


# ---- reference kernels against ONNX ------------------------------------------------------------
@pytest.mark.parametrize(("x", "w", "attrs"), [
    ((2, 4, 7, 7), (6, 4, 3, 3), {"pads": [1, 1, 1, 1]}),
    ((1, 4, 9, 8), (6, 2, 3, 2), {"pads": [1, 0, 2, 1], "strides": [2, 1], "dilations": [2, 1],
                                  "group": 2}),
    ((1, 4, 9, 8), (8, 1, 3, 3), {"pads": [1, 1, 1, 1], "group": 4}),
    ((1, 3, 8, 7), (2, 3, 3, 3), {"auto_pad": "SAME_LOWER", "strides": [2, 2]}),
    ((1, 3, 8, 7), (2, 3, 4, 4), {"auto_pad": "SAME_UPPER", "strides": [2, 2]}),
    ((2, 3, 10), (2, 3, 3), {"auto_pad": "VALID", "strides": [3]}),
    ((1, 2, 5, 4, 6), (3, 2, 2, 3, 2), {"pads": [1, 0, 1, 0, 1, 1]}),
])
def test_reference_conv_matches_onnx(x: tuple[int, ...], w: tuple[int, ...],
                                     attrs: dict[str, Any]) -> None:
    xs, ws, b = _f(*x), _f(*w), _f(w[0])
    np.testing.assert_allclose(ref(Op.CONV, [xs, ws, b], **attrs)[0],
                               onnx_reference("Conv", [xs, ws, b], **attrs)[0],
                               rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(("x", "w", "attrs"), [
    ((1, 3, 4, 5), (3, 2, 3, 3), {}),
    ((2, 3, 4, 5), (3, 2, 3, 3), {"strides": [2, 3], "pads": [1, 0, 1, 1],
                                  "output_padding": [1, 2]}),
    ((1, 3, 4, 5), (3, 2, 3, 2), {"dilations": [2, 2], "strides": [2, 1]}),
    ((1, 3, 4, 5), (3, 2, 3, 3), {"strides": [2, 2], "auto_pad": "SAME_UPPER"}),
    ((1, 3, 6), (3, 4, 3), {"strides": [2]}),
])
def test_reference_conv_transpose_matches_onnx(x: tuple[int, ...], w: tuple[int, ...],
                                               attrs: dict[str, Any]) -> None:
    xs, ws, b = _f(*x), _f(*w), _f(w[1])
    np.testing.assert_allclose(ref(Op.CONV_TRANSPOSE, [xs, ws, b], **attrs)[0],
                               onnx_reference("ConvTranspose", [xs, ws, b], **attrs)[0],
                               rtol=1e-5, atol=1e-5)


def test_conv_transpose_groups_and_output_shapes_match_onnxruntime() -> None:
    pytest.importorskip("onnxruntime", reason="onnxruntime is the oracle for these two "
                        "cases (onnx's reference evaluator does not implement them)")
    for x, w, attrs in (((1, 4, 5, 5), (4, 3, 3, 3), {"group": 2, "strides": [2, 2]}),
                        ((1, 3, 4, 5), (3, 2, 3, 3), {"strides": [2, 2],
                                                      "output_shape": [9, 10]}),
                        # past the full result: the output extends with zeros
                        ((1, 1, 3, 3), (1, 2, 3, 3), {"strides": [3, 2],
                                                      "output_shape": [10, 8]})):
        xs, ws = _f(*x), _f(*w)
        want = onnxruntime_node("ConvTranspose", [xs, ws], **attrs)[0]
        for kernel in (ref, cpu):
            np.testing.assert_allclose(kernel(Op.CONV_TRANSPOSE, [xs, ws], **attrs)[0], want,
                                       rtol=1e-5, atol=1e-5)


def test_reference_conv_integer_matches_onnx() -> None:
    x = RNG.integers(0, 256, (1, 3, 6, 6), dtype=np.uint8)
    w = RNG.integers(-128, 128, (4, 3, 3, 3), dtype=np.int8)
    xzp, wzp = np.array(7, np.uint8), np.array([1, 2, 3, 4], np.int8)
    want = onnx_reference("ConvInteger", [x, w, xzp, wzp], out_types=(np.int32,),
                          pads=[1, 1, 1, 1])[0]
    for kernel in (ref, cpu):
        got = kernel(Op.CONV_INTEGER, [x, w, xzp, wzp], pads=(1, 1, 1, 1))[0]
        assert got.dtype == np.int32
        np.testing.assert_array_equal(got, want)


# ---- every cpu variant against the reference -------------------------------------------------
_CASES: list[tuple[str, tuple[int, ...], tuple[int, ...], dict[str, Any]]] = [
    ("dense-3x3", (2, 5, 9, 8), (6, 5, 3, 3), {"pads": P1}),
    ("winograd-size", (2, 64, 15, 14), (64, 64, 3, 3), {"pads": (1, 0, 2, 1)}),
    ("strided-dilated", (1, 4, 13, 12), (6, 4, 3, 3), {"pads": P1, "strides": (2, 2),
                                                        "dilations": (2, 1)}),
    ("grouped", (2, 6, 8, 8), (6, 2, 3, 3), {"pads": P1, "group": 3}),
    ("pointwise", (2, 8, 6, 7), (16, 8, 1, 1), {}),
    ("pointwise-strided-grouped", (2, 8, 7, 7), (6, 4, 1, 1), {"strides": (2, 2), "group": 2}),
    ("depthwise", (2, 6, 9, 9), (6, 1, 3, 3), {"pads": P1, "group": 6}),
    ("depthwise-strided-multiplier", (1, 4, 10, 9), (8, 1, 3, 3),
     {"pads": (1, 1, 0, 1), "strides": (2, 2), "group": 4}),
    ("conv1d", (2, 3, 17), (4, 3, 3), {"pads": (1, 1), "strides": (2,)}),
    ("conv3d", (1, 2, 5, 6, 7), (3, 2, 3, 3, 3), {"pads": (1,) * 6}),
]


@pytest.mark.parametrize("variant", ["default", "im2col", "pointwise", "depthwise", "winograd"])
@pytest.mark.parametrize(("name", "x", "w", "attrs"), _CASES, ids=[c[0] for c in _CASES])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_cpu_variant_matches_reference(variant: str, name: str, x: tuple[int, ...],
                                       w: tuple[int, ...], attrs: dict[str, Any],
                                       dtype: Any) -> None:
    xs, ws, b = _f(*x, dtype=dtype), _f(*w, dtype=dtype), _f(w[0], dtype=dtype)
    case = conv_case(Op.CONV, x, w, get_schema(Op.CONV).normalize_attrs(attrs),
                     np.dtype(dtype).name)
    assert case is not None
    rule = cpu_conv.RULES.get(variant)
    if rule is not None and rule.cannot_serve(case) is not None:
        with pytest.raises(UnsupportedOperationError, match=f"variant '{variant}'"):
            cpu(Op.CONV, [xs, ws, b], variant, **attrs)
        return
    want = ref(Op.CONV, [xs, ws, b], **attrs)[0]
    out = np.empty(want.shape, dtype)
    (got,) = cpu(Op.CONV, [xs, ws, b], variant, out=[out], **attrs)
    assert got is out
    tol = 1e-4 if dtype == np.float32 else 1e-10
    np.testing.assert_allclose(got, want, rtol=tol, atol=tol)


@pytest.mark.parametrize("variant", ["im2col", "winograd", "pointwise", "depthwise"])
def test_fused_epilogue_equals_the_unfused_ops(variant: str) -> None:
    shapes: dict[str, tuple[tuple[int, ...], tuple[int, ...], dict[str, Any]]] = {
              "im2col": ((2, 8, 9, 9), (8, 8, 3, 3), {"pads": P1}),
              "winograd": ((1, 64, 14, 14), (64, 64, 3, 3), {"pads": P1}),
              "pointwise": ((2, 8, 6, 6), (16, 8, 1, 1), {}),
              "depthwise": ((2, 8, 9, 9), (8, 1, 3, 3), {"pads": P1, "group": 8})}
    x, w, attrs = shapes[variant]
    xs, ws, b = _f(*x), _f(*w), _f(w[0])
    plain = ref(Op.CONV, [xs, ws, b], **attrs)[0].astype(np.float64)
    z = _f(*plain.shape)
    (got,) = cpu(Op.CONV, [xs, ws, b, z], variant, activation="hard_swish", **attrs)
    want = plain + z
    want = want * np.clip(want / 6 + 0.5, 0, 1)
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)


def test_float16_is_computed_in_float32() -> None:
    xs, ws = _f(1, 3, 6, 6, dtype=np.float16), _f(4, 3, 3, 3, dtype=np.float16)
    (got,) = cpu(Op.CONV, [xs, ws], pads=P1)
    assert got.dtype == np.float16
    want = ref(Op.CONV, [xs.astype(np.float64), ws.astype(np.float64)], pads=P1)[0]
    np.testing.assert_allclose(got.astype(np.float64), want, rtol=5e-3, atol=2e-2)


def test_im2col_and_winograd_process_big_batches_in_chunks(monkeypatch: pytest.MonkeyPatch
                                                           ) -> None:
    monkeypatch.setattr(cpu_planner, "IM2COL_BYTES", 1)        # one image per chunk
    monkeypatch.setattr(cpu_planner, "STACKED_BYTES", 2 * 577 * 222 * 4)   # two images
    monkeypatch.setattr(cpu_planner, "WINOGRAD_CHUNK_BYTES", 1)
    cpu_conv._plan.cache_clear()                             # layouts are cached per shape
    try:
        # 14x14 outputs take the stacked im2col path, 20x20 ones the per-image path.
        for n, side in ((3, 14), (3, 20)):
            xs, ws, b = _f(n, 64, side, side), _f(64, 64, 3, 3), _f(64)
            want = ref(Op.CONV, [xs, ws, b], pads=P1, activation="relu")[0]
            for variant in ("im2col", "winograd"):
                (got,) = cpu(Op.CONV, [xs, ws, b], variant, pads=P1, activation="relu")
                np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)
    finally:
        cpu_conv._plan.cache_clear()


def test_default_runs_the_variant_the_rules_pick() -> None:
    for x, w, attrs in (((1, 64, 14, 14), (64, 64, 3, 3), {"pads": P1}),
                        ((1, 8, 6, 6), (16, 8, 1, 1), {}),
                        ((1, 8, 6, 6), (8, 1, 3, 3), {"pads": P1, "group": 8}),
                        ((1, 3, 12, 12), (8, 3, 7, 7), {"strides": (2, 2)})):
        xs, ws = _f(*x), _f(*w)
        norm = get_schema(Op.CONV).normalize_attrs(attrs)
        case = conv_case(Op.CONV, x, w, norm, "float32")
        assert case is not None
        chosen, _ = pick(case, cpu_planner.available_rules())   # what runs on this machine
        (by_default,) = cpu(Op.CONV, [xs, ws], **attrs)
        (by_name,) = cpu(Op.CONV, [xs, ws], chosen, **attrs)
        assert by_default.tobytes() == by_name.tobytes()


def test_conv_rules_explain_their_choice() -> None:
    numpy_rules = [r for r in cpu_conv.RULES.values() if r.variant != "native"]
    case = ConvCase(2, (3, 3), (1, 1), (1, 1), True, 1, 64, 64, (56, 56), 1, "float32")
    name, reason = pick(case, numpy_rules)
    assert name == "winograd"
    assert "64->64 channels" in reason and "faster than im2col" in reason
    small = ConvCase(2, (3, 3), (1, 1), (1, 1), True, 1, 64, 64, (7, 7), 1, "float32")
    name, reason = pick(small, numpy_rules)
    assert name == "im2col"
    assert "not winograd: 64 channels, 49 output pixels over the batch" in reason
    assert "slower than im2col" in reason and "batch 1" in reason
    batched = ConvCase(2, (3, 3), (1, 1), (1, 1), True, 1, 64, 64, (7, 7), 32, "float32")
    name, reason = pick(batched, numpy_rules)
    assert name == "winograd"                # 32 images: enough tiles for the GEMMs
    assert "batch 32" in reason
    with pytest.raises(LookupError, match="no conv variant serves"):
        pick(small, [cpu_conv.RULES["winograd"]])


# ---- winograd and the workspace --------------------------------------------------------------
def test_winograd_filter_transform_matches_its_definition() -> None:
    w = _f(3, 2, 3, 3, dtype=np.float64)
    u = winograd.filter_transform(np, w)                    # (4, 4, C, M)
    g = winograd.TRANSFORM_G
    want = np.einsum("xi,mcij,yj->xycm", g, w, g)
    np.testing.assert_allclose(u, want, rtol=1e-12)


def test_workspace_reuses_buffers_and_caches_only_frozen_constants() -> None:
    a = workspace.empty(np, "test-buffer", (4, 5), np.float32)
    assert workspace.empty(np, "test-buffer", (4, 5), np.float32) is a
    assert workspace.filled(np, "test-filled", (3,), np.float32, 2.0).tolist() == [2.0] * 3
    calls: list[int] = []

    def derive(xp: Any, w: np.ndarray) -> np.ndarray:
        calls.append(1)
        return w * 2

    live = np.ones(3)
    workspace.derived(np, "test", live, derive)
    workspace.derived(np, "test", live, derive)
    assert len(calls) == 2                                  # writeable: never cached
    frozen = np.ones(3)
    frozen.setflags(write=False)
    first = workspace.derived(np, "test", frozen, derive)
    assert workspace.derived(np, "test", frozen, derive) is first
    assert len(calls) == 3
    view = np.ones(3)[:]
    view.setflags(write=False)                              # its base is still writeable
    assert not workspace.is_frozen(view)


def test_unknown_variant_lists_the_ones_there() -> None:
    with pytest.raises(UnsupportedOperationError, match=r"variants here: .*winograd"):
        cpu(Op.CONV, [_f(1, 3, 5, 5), _f(4, 3, 3, 3)], "fft")


# ---- the layouts inside the variants ---------------------------------------------------------
def _geometry(x: tuple[int, ...], w: tuple[int, ...], attrs: dict[str, Any]) -> Any:
    return conv_geometry(Op.CONV, x, w, get_schema(Op.CONV).normalize_attrs(attrs))


def _want(xs: np.ndarray, ws: np.ndarray, b: np.ndarray | None, z: np.ndarray | None,
          attrs: dict[str, Any]) -> np.ndarray:
    plain = ref(Op.CONV, [xs, ws] + ([] if b is None else [b]), **attrs)[0]
    return np.clip(plain + (0 if z is None else z), 0, 6)


_IM2COL_CASES = [
    ("3x3", (3, 5, 9, 8), (6, 5, 3, 3), {"pads": P1}),
    ("strided-dilated", (2, 4, 13, 12), (6, 4, 3, 3),
     {"pads": P1, "strides": (2, 2), "dilations": (2, 1)}),
    ("stem-like", (2, 3, 20, 18), (8, 3, 7, 7), {"pads": (3, 3, 3, 3), "strides": (2, 2)}),
    ("grouped", (2, 6, 8, 8), (6, 2, 3, 3), {"pads": P1, "group": 3}),
    ("kernel-below-stride", (1, 3, 9, 9), (4, 3, 2, 2), {"strides": (3, 3)}),
    ("1-D", (3, 3, 17), (4, 3, 3), {"pads": (1, 1), "strides": (2,)}),
    ("3-D", (2, 2, 5, 6, 7), (3, 2, 3, 3, 3), {"pads": (1,) * 6}),
    ("4KiB rows", (1, 4, 32, 32), (5, 4, 3, 3), {"pads": P1}),    # 1024 float32 columns
]


@pytest.mark.parametrize(("name", "x", "w", "attrs"), _IM2COL_CASES,
                         ids=[c[0] for c in _IM2COL_CASES])
@pytest.mark.parametrize("compact", [True, False])
@pytest.mark.parametrize("stacked", [True, False])
def test_im2col_layouts_agree_with_the_reference(name: str, x: tuple[int, ...], w: tuple[int, ...],
                                                 attrs: dict[str, Any], compact: bool,
                                                 stacked: bool) -> None:
    geo = _geometry(x, w, attrs)
    # Chunks of one image, or the whole batch in one chunk when stacked.
    layout = conv_gemm.im2col_layout(geo, compact, stacked, x[0] if stacked else 1)
    assert layout.compact is compact and layout.stacked is (stacked and x[0] > 1)
    xs, ws, b = _f(*x), _f(*w), _f(w[0])
    z = _f(*geo.out_shape)
    y = np.empty(geo.out_shape, np.float32)
    conv_gemm.im2col(np, layout, xs, ws, b, z, y, ("clip", (0.0, 6.0)))
    np.testing.assert_allclose(y, _want(xs, ws, b, z, attrs), rtol=1e-4, atol=1e-4)


def test_column_rows_avoid_4kib_strides() -> None:
    assert conv_gemm.row_length(1024, np.float32) == 1040
    assert conv_gemm.row_length(512, np.float64) == 528
    assert conv_gemm.row_length(1086, np.float32) == 1086


@pytest.mark.parametrize(("x", "w", "attrs"), [
    ((3, 8, 6, 7), (16, 8, 1, 1), {}),                               # folds the bias
    ((3, 16, 6, 7), (8, 16, 1, 1), {}),                              # adds it after
    ((2, 8, 7, 7), (6, 4, 1, 1), {"strides": (2, 2), "group": 2}),
])
@pytest.mark.parametrize("stacked", [True, False])
def test_pointwise_layouts_agree_with_the_reference(x: tuple[int, ...], w: tuple[int, ...],
                                                    attrs: dict[str, Any],
                                                    stacked: bool) -> None:
    geo = _geometry(x, w, attrs)
    layout = conv_gemm.pointwise_layout(geo, True, stacked)
    assert layout.stacked is stacked
    xs, ws, b = _f(*x), _f(*w), _f(w[0])
    z = _f(*geo.out_shape)
    y = np.empty(geo.out_shape, np.float32)
    conv_gemm.pointwise(np, layout, xs, ws, b, z, y, ("clip", (0.0, 6.0)))
    np.testing.assert_allclose(y, _want(xs, ws, b, z, attrs), rtol=1e-4, atol=1e-4)


_DEPTHWISE_CASES = [
    ("3x3", (2, 6, 9, 8), (6, 1, 3, 3), {"pads": P1, "group": 6}),
    ("strided", (2, 5, 10, 11), (5, 1, 3, 3), {"pads": (1, 0, 1, 2), "strides": (2, 2),
                                                "group": 5}),
    ("dilated-5x5", (1, 4, 12, 12), (4, 1, 5, 5), {"pads": (2, 2, 2, 2), "dilations": (2, 1),
                                                    "group": 4}),
    ("multiplier", (1, 3, 8, 8), (6, 1, 3, 3), {"pads": P1, "strides": (1, 2), "group": 3}),
    ("3-D", (1, 3, 5, 6, 7), (3, 1, 3, 3, 3), {"pads": (1,) * 6, "group": 3}),
]


@pytest.mark.parametrize(("name", "x", "w", "attrs"), _DEPTHWISE_CASES,
                         ids=[c[0] for c in _DEPTHWISE_CASES])
@pytest.mark.parametrize("form", depthwise.FORMS)
@pytest.mark.parametrize("block", [1 << 20, 1])                 # 1 byte: one channel a block
def test_depthwise_forms_agree_with_the_reference(monkeypatch: pytest.MonkeyPatch, name: str,
                                                  x: tuple[int, ...], w: tuple[int, ...],
                                                  attrs: dict[str, Any], form: str,
                                                  block: int) -> None:
    monkeypatch.setattr(cpu_planner, "DEPTHWISE_BLOCK_BYTES", block)
    monkeypatch.setattr(cpu_planner, "DEPTHWISE_STREAM_BYTES", block)
    geo = _geometry(x, w, attrs)
    if form != "planes" and (len(x) != 4 or w[0] != x[1]) and not (
            form == "rows" and len(x) == 4):
        with pytest.raises(ValueError, match=f"form '{form}' cannot run"):
            cpu_planner.depthwise_layout(geo, form)
        return
    layout = cpu_planner.depthwise_layout(geo, form)
    xs, ws, b = _f(*x), _f(*w), _f(w[0])
    z = _f(*geo.out_shape)
    y = np.empty(geo.out_shape, np.float32)
    depthwise.depthwise(np, layout, xs, ws, b, z, y, ("clip", (0.0, 6.0)))
    np.testing.assert_allclose(y, _want(xs, ws, b, z, attrs), rtol=1e-4, atol=1e-4)


def test_depthwise_picks_its_form_by_shape() -> None:
    from keel.backends.cpu import native_window

    def form(x: tuple[int, ...], strides: tuple[int, int] = (1, 1)) -> str:
        """The NumPy form: the one that runs without the native tier (or on the GPU)."""
        c = x[1]
        geo = _geometry(x, (c, 1, 3, 3), {"pads": P1, "group": c, "strides": strides})
        layout = cpu_planner.depthwise_layout(geo)
        assert (layout.form == "native") == native_window.ready()
        if layout.form == "native":
            assert layout.fallback is not None
            return layout.fallback.form
        return layout.form

    assert form((1, 960, 7, 7)) == "channels_last"          # many channels, small planes
    assert form((1, 576, 14, 14), (2, 2)) == "channels_last"
    assert form((1, 32, 112, 112)) == "rows"
    assert form((8, 32, 112, 112)) == "planes"               # batches of big planes
    geo = _geometry((1, 3, 5, 6, 7), (3, 1, 3, 3, 3), {"pads": (1,) * 6, "group": 3})
    assert cpu_planner.depthwise_layout(geo).form == "planes"   # 3-D: NumPy only


def test_prepacked_and_plain_runs_agree_bitwise() -> None:
    """A kernel gives the same bytes whether or not its weights were prepacked."""
    import dataclasses

    for x, w, attrs in (((2, 8, 9, 9), (8, 8, 3, 3), {"pads": P1}),
                        ((2, 64, 8, 8), (64, 64, 3, 3), {"pads": P1}),
                        ((2, 8, 6, 6), (16, 8, 1, 1), {}),
                        ((2, 8, 9, 9), (8, 1, 3, 3), {"pads": P1, "group": 8})):
        xs, ws, b = _f(*x), _f(*w), _f(w[0])
        norm = get_schema(Op.CONV).normalize_attrs({**attrs, "activation": "relu"})
        kernel = cpu_conv.TABLE.get(Op.CONV)
        assert kernel.prepack is not None
        ctx = dataclasses.replace(CPU_CTX, prepacked=kernel.prepack(CPU_CTX, [None, ws, b],
                                                                    norm))
        assert isinstance(ctx.prepacked, workspace.Packed)
        plain = kernel.fn(CPU_CTX, [xs, ws, b], norm, None)[0]
        for _ in range(2):                                   # made, then reused
            packed = kernel.fn(ctx, [xs, ws, b], norm, None)[0]
            assert packed.tobytes() == plain.tobytes()
        other = _f(*w)                                       # not the prepacked weights
        np.testing.assert_allclose(kernel.fn(ctx, [xs, other, b], norm, None)[0],
                                   kernel.fn(CPU_CTX, [xs, other, b], norm, None)[0])


def test_workspace_binds_objects_per_key() -> None:
    made: list[int] = []

    class Held:
        nbytes = 8

    def make() -> Held:
        made.append(1)
        return Held()

    first = workspace.bound(np, ("test-bound", 1), make)
    assert workspace.bound(np, ("test-bound", 1), make) is first and len(made) == 1
    assert workspace.bound(np, ("test-bound", 2), make) is not first
