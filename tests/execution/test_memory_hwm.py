"""Under a memory limit the process's measured peak stays within the limit plus a fixed overhead.

A subprocess saves a 8 MiB-weight MLP as ``.keel``, resets its peak resident
set (``/proc/self/clear_refs``), loads the model under a limit that forces
chunking, runs a 2,048-row batch and reads ``VmHWM``: the growth from before
the load must stay within the limit plus ``FIXED_OVERHEAD`` (what keel does
not count: interpreter objects, BLAS buffers, temporaries inside one step).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

LIMIT = 26 << 20
FIXED_OVERHEAD = 12 << 20

_SCRIPT = """
import gc, json, sys
import numpy as np
from onnx import TensorProto, helper, numpy_helper
import keel
from keel.formats.keel_format import save_keel
from keel.graph.importers.onnx import import_onnx


def status():
    with open("/proc/self/status") as f:
        pairs = (line.split(":", 1) for line in f)
        return {k: int(v.split()[0]) * 1024 for k, v in pairs if k in ("VmRSS", "VmHWM")}


rng = np.random.default_rng(0)
w1, w2 = (rng.standard_normal((1024, 1024), dtype=np.float32) for _ in range(2))
graph = helper.make_graph(
    [helper.make_node("MatMul", ["x", "w1"], ["h"]), helper.make_node("Relu", ["h"], ["r"]),
     helper.make_node("MatMul", ["r", "w2"], ["y"])], "mlp",
    [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["b", 1024])],
    [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["b", 1024])],
    [numpy_helper.from_array(w1, "w1"), numpy_helper.from_array(w2, "w2")])
save_keel(import_onnx(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])),
          sys.argv[1])
x = np.ones((2048, 1024), np.float32)
del graph, w1, w2
gc.collect()
before = status()
with open("/proc/self/clear_refs", "w") as f:
    f.write("5")                                  # VmHWM restarts from the current RSS
model = keel.load_model(sys.argv[1], memory_limit=int(sys.argv[2]))
y = model.predict({"x": x})["y"]
print(json.dumps({"before": before, "after": status(), "chunked": model.plan.chunk_size_hint,
                  "rows": int(y.shape[0])}))
"""


@pytest.mark.skipif(not Path("/proc/self/clear_refs").exists(), reason="needs Linux's /proc")
def test_the_peak_under_a_limit_stays_within_it_plus_the_fixed_overhead(tmp_path: Path) -> None:
    root = Path(__file__).resolve().parents[2]
    env = {**os.environ, "PYTHONPATH": f"{root}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    done = subprocess.run([sys.executable, "-c", _SCRIPT, str(tmp_path / "mlp.keel"),
                           str(LIMIT)], capture_output=True, text=True, timeout=300,
                          cwd=root, env=env, check=False)
    assert done.returncode == 0, done.stderr[-2000:]
    seen = json.loads(done.stdout.strip().splitlines()[-1])
    assert seen["rows"] == 2048 and seen["chunked"] is not None, seen     # it really chunked
    growth = seen["after"]["VmHWM"] - seen["before"]["VmRSS"]
    assert growth <= LIMIT + FIXED_OVERHEAD, seen
