"""``import keel`` stays light: no optional or heavy package is imported with it."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

HEAVY = ("cupy", "pynvml", "onnxruntime", "torch", "ray", "onnx")


def _imported_after(code: str) -> list[str]:
    probe = (f"{code}\nimport json, sys\n"
             f"print(json.dumps(sorted(m for m in {HEAVY!r} if m in sys.modules)))")
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                         check=True)
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
