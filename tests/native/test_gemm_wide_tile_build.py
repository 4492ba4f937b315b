"""gemm.c built with three vectors a tile row (``KEEL_CFLAGS=-DKEEL_GEMM_NV=3``: 8 x 48
tiles with AVX-512, the build docs/performance.md measured) loads without its lanes tiles,
which are built with the 8 x 32 tile only (the cpu planner's LANES_GRID), and its conv
matches the reference backend. A subprocess builds it into a fresh cache."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from keel import native

SCRIPT = """
import json
import numpy as np
import keel
from keel.backends.cpu import native_gemm, planner
from tests.backends.test_plan_caches import _expansion_model

f = native_gemm._functions()
x = np.random.default_rng(5).standard_normal((1, 96, 14, 14)).astype(np.float32)
got = keel.load_model(_expansion_model(), backend="cpu", threads=1).run(None, {"x": x})[0]
want = keel.load_model(_expansion_model(), backend="reference").run(None, {"x": x})[0]
print(json.dumps({"grid": [f.mr, f.nr], "built": bool(f.lanes_built),
                  "planned": planner.lanes_built(), "error": float(np.abs(got - want).max())}))
"""


def test_a_three_vector_tile_build_loads_without_lanes_tiles(tmp_path: Path) -> None:
    if not native.status().available:
        pytest.skip(f"native tier unavailable: {native.status().reason}")
    root = Path(__file__).resolve().parents[2]
    env = {**os.environ, "KEEL_CFLAGS": "-DKEEL_GEMM_NV=3", "KEEL_NATIVE": "on",
           "KEEL_CACHE_DIR": str(tmp_path / "cache"), "KEEL_BUILD_TIMEOUT": "600",
           "PYTHONPATH": f"{root}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    done = subprocess.run([sys.executable, "-c", SCRIPT], cwd=root, env=env,
                          capture_output=True, text=True, timeout=900, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    found = json.loads(done.stdout.strip().splitlines()[-1])
    assert found["grid"][1] % 3 == 0 and found["grid"][1] != 32, found   # three vectors
    assert found["built"] is False and found["planned"] is False, found
    assert found["error"] < 1e-4, found
