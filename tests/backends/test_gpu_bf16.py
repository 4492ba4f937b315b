"""bfloat16 on the gpu backend without a GPU: the emulating CuPy, the fake cuDNN
frontend, and the CUDA sources compiled for compute_90 by the CUDA toolkit's nvcc.

What runs here: every bfloat16 conformance case through the gpu planner's choice on
``EmulatedCupy`` against the reference (the gpu's own kernels are NumPy twins there,
and the cuBLAS GemmEx calls keel makes are emulated from the pointers, types and
leading dimensions it passes); the cuBLAS and cuDNN calls carry bfloat16 data with
float32 compute; ``precision="bf16"`` on a model; the RawKernel sources build for
``bf16_t``. What does not: the CUDA code itself on a device (the conformance suite's
gpu cases run that on a real GPU).
"""

from __future__ import annotations

import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

import keel
from keel.backends.gpu import cudnn_lib
from keel.backends.gpu import fused_cuda as cu
from keel.backends.gpu.backend import GpuBackend
from keel.backends.gpu.cudnn_lib import CudnnLibrary
from keel.backends.registry import BackendRegistry, builtin_registry
from keel.dtypes import DType
from keel.ops.registry import Op
from tests.backends.fakes import EmulatedCupy, FakeCudnn
from tests.conformance.harness import OpCase, assert_outputs_match, collect_cases, run_case

BF16 = DType.BFLOAT16.numpy
REFERENCE = builtin_registry().instance("reference")
# The other ml_dtypes types stay on the host (casts between them and bfloat16 are the
# cpu's).
_HOST_ONLY = ("float8", "float4", "int4", "int2")
CASES = [pytest.param(c, id=c.id) for c in collect_cases()
         if ("bfloat16" in c.id or c.id.endswith("-bf16"))
         and not any(name in c.id for name in _HOST_ONLY)]


@pytest.fixture
def fake_cudnn(monkeypatch: pytest.MonkeyPatch) -> Iterator[FakeCudnn]:
    fake = FakeCudnn()
    monkeypatch.setattr(cudnn_lib, "LIBRARY", CudnnLibrary(lambda: fake))
    yield fake


@pytest.mark.usefixtures("fake_cudnn")
@pytest.mark.parametrize("case", CASES)
def test_bfloat16_case_on_the_emulated_gpu(case: OpCase) -> None:
    gpu = GpuBackend(cupy_module=EmulatedCupy())
    expected = run_case(REFERENCE, case)
    for strided in (False, True):
        got = run_case(gpu, case, make_strided=strided)
        assert_outputs_match(got, expected, case, f" (emulated gpu, strided={strided})")


def test_bfloat16_products_call_cublas_with_float32_compute() -> None:
    cupy = EmulatedCupy()
    gpu = GpuBackend(cupy_module=cupy)
    rng = np.random.default_rng(3)
    a, b = (rng.standard_normal(s).astype(BF16) for s in ((2, 5, 7), (7, 3)))
    q = rng.standard_normal((2, 2, 4, 8)).astype(BF16)
    gpu.run(Op.MATMUL, [gpu.to_device(a), gpu.to_device(b)], variant="cublas")
    gpu.run(Op.ATTENTION, [gpu.to_device(q)] * 3, variant="fused")
    calls = cupy.cuda.cublas.calls
    assert [c[0] for c in calls] == ["gemmEx", "gemmStridedBatchedEx", "gemmStridedBatchedEx"]
    # operands and output CUDA_R_16BF (14), compute CUBLAS_COMPUTE_32F (68)
    assert {c[1:] for c in calls} == {(14, 14, 14, 68)}
    assert cupy.cuda.cublas.streams == {0x0B1A5: cupy.stream.ptr}


def test_a_transposed_weight_is_a_cublas_flag_not_a_copy() -> None:
    cupy = EmulatedCupy()
    gpu = GpuBackend(cupy_module=cupy)
    rng = np.random.default_rng(4)
    a, w = rng.standard_normal((4, 6)).astype(BF16), rng.standard_normal((5, 6)).astype(BF16)
    got = gpu.run(Op.GEMM, [a, w], attrs={"trans_b": 1}, variant="cublas")[0]
    want = REFERENCE.run(Op.GEMM, [a, w], attrs={"trans_b": 1})[0]
    np.testing.assert_array_equal(got, want)          # one rounding of a float32 sum


def test_bfloat16_conv_builds_a_bfloat16_graph_computing_in_float32(
        fake_cudnn: FakeCudnn) -> None:
    gpu = GpuBackend(cupy_module=EmulatedCupy())
    rng = np.random.default_rng(5)
    x, w, b = (rng.standard_normal(s).astype(BF16) for s in ((1, 3, 6, 6), (4, 3, 3, 3), (4,)))
    attrs = {"pads": (1, 1, 1, 1), "activation": "relu"}
    got = gpu.run(Op.CONV, [x, w, b], attrs=attrs, variant="cudnn")[0]
    want = REFERENCE.run(Op.CONV, [x, w, b], attrs=attrs)[0]
    assert got.dtype == BF16
    np.testing.assert_allclose(got.astype(np.float32), want.astype(np.float32),
                               rtol=3e-2, atol=1e-1)
    graph = fake_cudnn.builds[-1]
    assert graph.kwargs["io_data_type"] == "BFLOAT16"
    assert graph.kwargs["compute_data_type"] == graph.kwargs["intermediate_data_type"] == "FLOAT"
    assert "TENSOR_CORE" not in graph.notes_deselected      # tensor cores stay allowed


def _emulated_registry() -> BackendRegistry:
    registry = BackendRegistry()
    gpu = type("EmulatedGpu", (GpuBackend,), {
        "__init__": lambda self: GpuBackend.__init__(self, cupy_module=EmulatedCupy())})
    registry.register("gpu", gpu, 10)
    return registry


@pytest.mark.usefixtures("fake_cudnn")
def test_a_model_at_bf16_on_the_emulated_gpu_stays_near_fp32() -> None:
    from benchmarks.zoo import MODELS, build

    data, feeds = build("lenet"), MODELS["lenet"].make_feeds(2)
    want = keel.load_model(data, backend="reference").predict(feeds)
    model = keel.load_model(data, backend="gpu", precision="bf16",
                            registry=_emulated_registry())
    got = model.predict(feeds)
    for key, ref in want.items():
        assert got[key].dtype == ref.dtype                  # declared outputs keep their dtype
        error = np.linalg.norm(got[key] - ref) / np.linalg.norm(ref)
        assert 1e-5 < error < 2e-2, error                   # bfloat16 math, near fp32
    text = model.explain()
    assert "precision bf16" in text
    assert {n.precision for n in model.plan.nodes if n.op == "conv"} == {"bf16"}


# ---- the CUDA sources, compiled ---------------------------------------------------------
def _nvcc() -> str | None:
    return shutil.which("nvcc") or next(
        (str(p) for p in (Path("/usr/local/cuda/bin/nvcc"),) if p.exists()), None)


@pytest.mark.parametrize("element", ["float", "half_t", "bf16_t"])
def test_raw_kernel_sources_compile_for_compute_90(element: str, tmp_path: Path) -> None:
    nvcc = _nvcc()
    if nvcc is None:
        pytest.skip("no CUDA toolkit (nvcc) here to compile the kernel sources")
    from keel.backends.gpu import fused_norm, fused_pool

    bodies = (fused_norm._LAYER_NORM, fused_norm._SOFTMAX, fused_pool._WINDOW, fused_pool._ROWS)
    source = tmp_path / "kernels.cu"
    source.write_text(cu.source("\n".join(bodies), element))
    done = subprocess.run([nvcc, "--ptx", "-arch=compute_90", "-o", str(tmp_path / "k.ptx"),
                           str(source)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    ptx = (tmp_path / "k.ptx").read_text()
    for name in ("keel_layer_norm", "keel_softmax", "keel_pool2d", "keel_row_reduce"):
        assert f".entry {name}(" in ptx
    if element == "bf16_t":
        assert "cvt.rn.bf16.f32" in ptx              # stores round to nearest even
