"""100,000 predicts of a small model hold their memory: no growth past a fixed bound.

The run is a subprocess, so its resident set is the model's alone. It reads
``VmRSS`` from ``/proc/self/status`` after a warm-up (the arena bound, the
kernels' packed weights made, the first allocations' pages touched) and again
at the end; a leak of even 100 bytes a predict would add about 10 MiB.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

PREDICTS = 100_000
WARM_UP = 2_000
GROWTH_BOUND = 4 << 20        # bytes of RSS growth allowed from warm-up to the end

_SCRIPT = """
import json, sys
import numpy as np
import keel
from keel.graph.importers.onnx import import_onnx
from tests.graph import models as M
from tests.graph.test_passes import feeds_of


def status():
    with open("/proc/self/status") as f:
        pairs = (line.split(":", 1) for line in f)
        return {k: int(v.split()[0]) * 1024 for k, v in pairs if k in ("VmRSS", "VmHWM")}


proto = M.mlp(np.random.default_rng(1))
model = keel.load_model(proto.SerializeToString())
feeds = feeds_of(import_onnx(proto), np.random.default_rng(0), batch=2)
for _ in range(int(sys.argv[2])):
    model.predict(feeds)
warm = status()
for _ in range(int(sys.argv[1]) - int(sys.argv[2])):
    model.predict(feeds)
print(json.dumps({"warm": warm, "end": status()}))
"""


@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="needs Linux's /proc")
def test_a_hundred_thousand_predicts_do_not_grow_the_resident_set() -> None:
    root = Path(__file__).resolve().parents[2]
    env = {**os.environ, "PYTHONPATH": f"{root}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    done = subprocess.run([sys.executable, "-c", _SCRIPT, str(PREDICTS), str(WARM_UP)],
                          capture_output=True, text=True, timeout=300, cwd=root, env=env,
                          check=False)
    assert done.returncode == 0, done.stderr[-2000:]
    seen = json.loads(done.stdout.strip().splitlines()[-1])
    warm, end = seen["warm"], seen["end"]
    assert end["VmRSS"] - warm["VmRSS"] <= GROWTH_BOUND, seen
    assert end["VmHWM"] - warm["VmHWM"] <= GROWTH_BOUND, seen
