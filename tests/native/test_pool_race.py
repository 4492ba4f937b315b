"""keel's pool under stalls where a preemption opens a window between two threads' steps
(threads.c's KEEL_POOL_PAUSE points): the caller between a job's shape and its ticket,
a worker between the ticket it read and the shape. Every chunk of every job must run
exactly once, with its own bounds, before the job returns (tests/native/data/pool_race.c
checks each). A worker late for a finished job once ran a chunk of the next one with the
last job's bounds, counted towards the new job: these stalls showed it in every run."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from keel.native import toolchain

SOURCE = Path(__file__).resolve().parents[2] / "keel" / "native" / "src" / "threads.c"
DRIVER = Path(__file__).resolve().parent / "data" / "pool_race.c"


@pytest.fixture(scope="module")
def driver(tmp_path_factory: pytest.TempPathFactory) -> Path:
    if not sys.platform.startswith("linux"):
        pytest.skip("the driver forks and links pthreads as on Linux")
    compiler, why = toolchain.find_compiler()
    if compiler is None:
        pytest.skip(why)
    out = tmp_path_factory.mktemp("pool_race")
    header = out / "pause.h"
    header.write_text("#include <stdint.h>\nvoid keel_test_pause(int where, int64_t id);\n")
    exe = out / "pool_race"
    subprocess.run([compiler.path, "-O2", "-std=c11", "-pthread", "-D_GNU_SOURCE",
                    "-DKEEL_POOL_PAUSE(w)=keel_test_pause((w), pool_id)", "-include",
                    str(header), str(SOURCE), str(DRIVER), "-o", str(exe)],
                   check=True, capture_output=True, text=True, timeout=120)
    return exe


@pytest.mark.parametrize(("mode", "caller_us", "worker_us", "affinity"), [
    (0, 200, 0, 1),      # 2 and 8 chunks in turn, the caller stalled before each ticket
    (1, 100, 0, 1),      # random chunk counts and caps, stop and fork now and then
    (0, 0, 200, 1),      # workers stalled between the ticket and the shape
    (1, 100, 100, 0),    # both, every chunk from the ticket (no owners)
    (1, 0, 0, 1),        # no stall
])
def test_every_chunk_runs_once_with_its_bounds_before_its_job_returns(
        driver: Path, mode: int, caller_us: int, worker_us: int, affinity: int) -> None:
    done = subprocess.run([str(driver), "2000", str(mode), str(caller_us), str(worker_us),
                           str(affinity)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.strip() == "jobs=2000 missing=0 twice=0 late=0 bad=0"
