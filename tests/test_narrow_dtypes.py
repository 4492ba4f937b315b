"""bfloat16, float8, float4 and the 4- and 2-bit integers: packing, ONNX tensors in every
encoding, the .keel format, export, QuantizeLinear/DequantizeLinear against onnx's
reference evaluator, and other ops computed wide between the importer's casts."""

from __future__ import annotations

from pathlib import Path

import ml_dtypes
import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper
from onnx.reference import ReferenceEvaluator

import keel
from keel.dtypes import NARROW, DType, as_dtype, pack, packed_size, unpack
from keel.errors import ModelFormatError
from keel.formats.keel_format import load_keel, save_keel
from keel.graph.export import to_onnx
from keel.graph.importers.onnx import import_onnx
from keel.ops.registry import Op

SUB_BYTE = [DType.INT4, DType.UINT4, DType.INT2, DType.UINT2, DType.FLOAT4E2M1]


def _values(dtype: DType, n: int, rng: np.random.Generator) -> np.ndarray:
    if dtype.value.startswith(("int", "uint")):
        info = ml_dtypes.iinfo(dtype.numpy)
        return rng.integers(int(info.min), int(info.max), n, endpoint=True).astype(dtype.numpy)
    return rng.uniform(-6, 6, n).astype(dtype.numpy)


@pytest.mark.parametrize("dtype", sorted(NARROW, key=lambda d: d.value), ids=str)
@pytest.mark.parametrize("n", [0, 1, 3, 8, 13])
def test_pack_is_onnx_raw_data_and_unpack_inverts_it(dtype: DType, n: int) -> None:
    x = _values(dtype, n, np.random.default_rng(n))
    raw = pack(x)
    assert raw == numpy_helper.from_array(x).raw_data
    assert len(raw) == packed_size(dtype, n)
    back = unpack(raw, dtype, n)
    assert back.dtype == x.dtype
    np.testing.assert_array_equal(back.astype(np.float32), x.astype(np.float32))


def test_names_and_codes() -> None:
    assert as_dtype("bf16") is DType.BFLOAT16 and as_dtype("float8e4m3fn") is DType.FLOAT8E4M3FN
    assert DType.from_onnx(TensorProto.INT4) is DType.INT4
    assert DType.from_numpy(ml_dtypes.float8_e5m2) is DType.FLOAT8E5M2
    assert DType.INT4.bits == 4 and DType.INT2.bits == 2 and DType.BFLOAT16.bits == 16
    assert not DType.INT4.is_int and not DType.BFLOAT16.is_float and DType.INT4.is_narrow


def _tensor_in_fields(name: str, x: np.ndarray) -> onnx.TensorProto:
    """``x`` in int32_data (bit patterns, packed bytes for the sub-byte types)."""
    dtype = DType.from_numpy(x.dtype)
    codes = np.frombuffer(pack(x), dtype=np.uint16 if dtype.itemsize == 2 else np.uint8)
    t = TensorProto(name=name, data_type=dtype.onnx, dims=x.shape)
    t.int32_data.extend(int(c) for c in codes)
    return t


@pytest.mark.parametrize("dtype", sorted(NARROW, key=lambda d: d.value), ids=str)
@pytest.mark.parametrize("encoding", ["raw", "fields", "external"])
def test_initializers_import_and_survive_keel_and_onnx_export(dtype: DType, encoding: str,
                                                               tmp_path: Path) -> None:
    x = _values(dtype, 15, np.random.default_rng(3)).reshape(3, 5)
    t = numpy_helper.from_array(x, "w") if encoding != "fields" else _tensor_in_fields("w", x)
    node = helper.make_node("Identity", ["w"], ["y"])
    graph = helper.make_graph([node], "g", [], [helper.make_tensor_value_info(
        "y", dtype.onnx, [3, 5])], [t])
    m = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 25)])
    if encoding == "external":
        onnx.save_model(m, tmp_path / "m.onnx", save_as_external_data=True,
                        all_tensors_to_one_file=True, location="w.bin", size_threshold=0)
        g = import_onnx(tmp_path / "m.onnx")
    else:
        g = import_onnx(m)
    want = x.astype(np.float32)
    np.testing.assert_array_equal(g.initializers["w"].astype(np.float32), want)
    assert g.initializers["w"].dtype == x.dtype
    save_keel(g, tmp_path / "m.keel", compress=True)
    back = load_keel(tmp_path / "m.keel").initializers["w"]
    assert back.dtype == x.dtype
    np.testing.assert_array_equal(back.astype(np.float32), want)
    exported = {i.name: numpy_helper.to_array(i) for i in to_onnx(g).graph.initializer}
    np.testing.assert_array_equal(exported["w"].astype(np.float32), want)


def test_packed_raw_data_of_the_wrong_length_is_a_format_error() -> None:
    t = TensorProto(name="w", data_type=TensorProto.INT4, dims=[5], raw_data=b"\x12\x34")
    graph = helper.make_graph([helper.make_node("Identity", ["w"], ["y"])], "g", [],
                              [helper.make_tensor_value_info("y", TensorProto.INT4, [5])], [t])
    with pytest.raises(ModelFormatError, match=r"declares 5 int4 elements \(3 bytes\)"):
        import_onnx(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 25)]))


def _run_both(m: onnx.ModelProto, feeds: dict[str, np.ndarray]) -> tuple[list, list]:
    expected = ReferenceEvaluator(m).run(None, feeds)
    model = keel.load_model(m.SerializeToString(), backend="cpu", plan_cache=False)
    return model.run(None, feeds), expected


@pytest.mark.parametrize("dtype", [DType.INT4, DType.UINT4, DType.INT2, DType.FLOAT8E4M3FN,
                                   DType.FLOAT8E5M2, DType.FLOAT4E2M1], ids=str)
def test_blocked_quantize_dequantize_round_trip_matches_onnx(dtype: DType) -> None:
    """x -> QuantizeLinear (blocks of 4 along axis 1) -> DequantizeLinear, as onnx computes."""
    rng = np.random.default_rng(7)
    x = rng.uniform(-4, 4, (3, 8)).astype(np.float32)
    scale = rng.uniform(0.2, 1.0, (3, 2)).astype(np.float32)
    zp = numpy_helper.from_array(np.zeros((3, 2), dtype.numpy), "zp")
    q = helper.make_node("QuantizeLinear", ["x", "s", "zp"], ["q"], axis=1, block_size=4)
    dq = helper.make_node("DequantizeLinear", ["q", "s", "zp"], ["y"], axis=1, block_size=4)
    graph = helper.make_graph(
        [q, dq], "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [3, 8])],
        [helper.make_tensor_value_info("q", dtype.onnx, [3, 8]),
         helper.make_tensor_value_info("y", TensorProto.FLOAT, [3, 8])],
        [numpy_helper.from_array(scale, "s"), zp])
    got, want = _run_both(helper.make_model(graph, opset_imports=[
        helper.make_opsetid("", 25)]), {"x": x})
    assert got[0].dtype == want[0].dtype
    np.testing.assert_array_equal(got[0].astype(np.float32), want[0].astype(np.float32))
    np.testing.assert_allclose(got[1], want[1], rtol=1e-6)


def test_bfloat16_ops_compute_in_float32_between_casts() -> None:
    """A bfloat16 MatMul + Add: the importer casts up, runs float32 ops, casts back."""
    rng = np.random.default_rng(5)
    w = rng.standard_normal((4, 3)).astype(ml_dtypes.bfloat16)
    nodes = [helper.make_node("MatMul", ["x", "w"], ["h"]),
             helper.make_node("Add", ["h", "x2"], ["y"])]
    bf = TensorProto.BFLOAT16
    graph = helper.make_graph(
        nodes, "g", [helper.make_tensor_value_info("x", bf, [2, 4]),
                     helper.make_tensor_value_info("x2", bf, [2, 3])],
        [helper.make_tensor_value_info("y", bf, [2, 3])], [numpy_helper.from_array(w, "w")])
    m = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)])
    g = import_onnx(m)
    assert [n.op for n in g.nodes].count(Op.CAST) >= 3
    assert all(g.value_types[n.outputs[0]].dtype is DType.FLOAT32
               for n in g.nodes if n.op in (Op.MATMUL, Op.ADD))
    feeds = {"x": rng.standard_normal((2, 4)).astype(ml_dtypes.bfloat16),
             "x2": rng.standard_normal((2, 3)).astype(ml_dtypes.bfloat16)}
    got = keel.load_model(m.SerializeToString(), backend="cpu", plan_cache=False).run(
        None, feeds)[0]
    exact = (feeds["x"].astype(np.float32) @ w.astype(np.float32)
             + feeds["x2"].astype(np.float32)).astype(ml_dtypes.bfloat16)
    assert got.dtype == exact.dtype
    np.testing.assert_array_equal(got.astype(np.float32), exact.astype(np.float32))


def test_the_gpu_backend_holds_bfloat16_and_no_other_ml_dtypes_type() -> None:
    from keel.backends.cpu.backend import CpuBackend
    from keel.backends.gpu.backend import GpuBackend

    assert DType.BFLOAT16 in CpuBackend.dtypes and DType.BFLOAT16 in GpuBackend.dtypes
    assert GpuBackend.dtypes & NARROW == {DType.BFLOAT16}


@pytest.mark.parametrize("dtype", sorted(NARROW, key=lambda d: d.value))
def test_the_item_sizes_keel_knows_without_ml_dtypes_are_ml_dtypes_own(dtype: DType) -> None:
    assert dtype.itemsize == np.dtype(getattr(ml_dtypes, dtype.value)).itemsize
