"""``import keel`` stays light: no optional or heavy package is imported with it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

HEAVY = ("cupy", "pynvml", "onnxruntime", "torch", "ray", "onnx")


def _imported_after(code: str, watched: tuple[str, ...] = HEAVY,
                    env: dict[str, str] | None = None) -> list[str]:
    probe = (f"{code}\nimport json, sys\n"
             f"print(json.dumps(sorted(m for m in {watched!r} if m in sys.modules)))")
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                         check=True, env=env)
    return list(json.loads(out.stdout.strip().splitlines()[-1]))


def test_import_keel_imports_no_optional_package() -> None:
    assert _imported_after("import keel") == []


def test_importing_the_gpu_backend_does_not_import_cupy() -> None:
    code = ("import keel.backends.gpu.backend, keel.backends.gpu.kernels, "
            "keel.backends.registry, keel.runtime, keel.tensors, keel.planning.selection")
    assert _imported_after(code) == []


@pytest.mark.parametrize("code", [
    "import keel; keel.Runtime(backend='cpu')",
    "import keel; keel.tensor([1.0, 2.0]).sum()",
])
def test_runtime_and_tensors_load_only_cupy_and_only_to_check_the_gpu(code: str) -> None:
    # Automatic selection asks the gpu backend whether it is available, which
    # tries ``import cupy``; nothing else optional is ever loaded.
    loaded = _imported_after(code)
    assert [m for m in loaded if m != "cupy"] == []


def test_keel_onnxruntime_imports_neither_onnxruntime_nor_onnx() -> None:
    # The drop-in mirrors onnxruntime's API without loading it (or onnx) to do so.
    assert _imported_after("import keel.onnxruntime as ort; ort.SessionOptions()") == []


# What a fresh process that loads a .keel model and predicts must not import: onnx and
# protobuf (a .keel file needs no importer), asyncio with ssl (8 MB), hashlib (OpenSSL's
# libcrypto, 3.6 MB: small inputs hash with Python's own SHA-256), yaml, numpy.random,
# importlib.metadata (2 MB: asked only when an installed distribution declares a keel
# backend), ml_dtypes (a model without narrow types), concurrent.futures with logging (native
# builds and tree models use threads of their own), kernel families of ops LeNet does not
# have (the tables import a family on first use), the int8 kernels' module (a float model),
# numpy.polynomial (erf's coefficients), calibration's sweep (selection and the cache key
# read the record, keel.planning.calibration_record), the edge/server target profiles,
# subprocess (its kernels built, a process starts no compiler and the probe no tool that is
# not there) and, on Linux, psutil with socket (the probe reads /proc and sysfs, which is
# what psutil reads there: ~8 ms of imports).
NOT_FOR_A_KEEL_PREDICT = ("onnx", "google.protobuf", "keel.graph.importers.onnx", "asyncio",
                          "ssl", "hashlib", "yaml", "numpy.random", "importlib.metadata",
                          "ml_dtypes", "concurrent.futures", "logging",
                          "keel.backends.cpu.trees", "keel.backends.cpu.recurrent",
                          "keel.backends.reference.elementwise",
                          "keel.backends.cpu.native_qgemm", "numpy.polynomial",
                          "keel.planning.calibration", "keel.planning.targets", "subprocess",
                          *(("psutil", "socket") if sys.platform.startswith("linux") else ()))
# And what a model found in the compiled-plan cache skips besides (what every process after
# the first finds): the graph passes (and the quantization schemas their QDQ pass reads),
# backend selection, placement itself (the plan's records are in keel.planning.plans) with
# its kernel variants and tuning records, the reference backend's kernels, and the regions of
# independent branches (a plan without any).
NOT_FOR_A_CACHED_PREDICT = ("keel.graph.passes", "keel.graph.subgraphs",
                            "keel.ops.schemas.quantization", "keel.planning.selection",
                            "keel.planning.placement", "keel.planning.interop",
                            "keel.planning.variants", "keel.planning.tuning",
                            "keel.backends.reference.kernels")


@pytest.mark.parametrize("plan_cache", ["off", "on"])
def test_a_keel_file_predicts_without_the_modules_it_does_not_need(
        tmp_path: Path, plan_cache: str) -> None:
    from keel.backends.registry import _may_declare_backends
    from keel.cli.convert import convert_model
    from keel.testing.models import lenet

    onnx_path = tmp_path / "lenet.onnx"
    onnx_path.write_bytes(lenet().SerializeToString())
    convert_model(onnx_path, tmp_path / "lenet.keel")
    code = ("import numpy as np, keel\n"
            f"m = keel.load_model({str(tmp_path / 'lenet.keel')!r})\n"
            "m.predict({i.name: np.zeros([1 if not isinstance(d, int) else d for d in i.shape],"
            " np.float32) for i in m.inputs})")
    env = {**os.environ, "KEEL_PLAN_CACHE": plan_cache}    # the session's native builds
    watched = tuple(m for m in NOT_FOR_A_KEEL_PREDICT
                    if m != "importlib.metadata" or not _may_declare_backends())
    _imported_after(code, (), {**env, "KEEL_PLAN_CACHE": "off"})   # kernels built, if not yet
    assert _imported_after(code, watched, env) == []
    if plan_cache == "on":                              # stored, now found
        assert _imported_after(code, watched + NOT_FOR_A_CACHED_PREDICT, env) == []
