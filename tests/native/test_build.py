"""The native tier: compiler discovery, builds, the cache, KEEL_NATIVE, the thread pool."""

from __future__ import annotations

import ctypes
import json
import os
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from keel import config, native
from keel.errors import BackendSelectionError, InvalidArgumentError
from keel.native import build, pool
from keel.native.toolchain import find_compiler

ADD_ONE = "int keel_add_one(int x) { return x + 1; }\n"


@pytest.fixture
def fresh(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Iterator[Path]:
    """A private cache and source folder, and a native tier that forgets what it found."""
    src = tmp_path / "src"
    src.mkdir()
    monkeypatch.setenv("KEEL_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.delenv("KEEL_NATIVE", raising=False)     # the build machinery itself
    config.reload_settings()
    monkeypatch.setattr(build, "SOURCE_DIR", src)
    native.reset()
    yield src
    native.reset()


def _needs_compiler() -> None:
    compiler, why = find_compiler()
    if compiler is None:
        pytest.skip(f"native tier unavailable: {why}")


def test_library_builds_loads_and_is_cached(fresh: Path) -> None:
    _needs_compiler()
    (fresh / "adder.c").write_text(ADD_ONE)
    lib = native.library("adder")
    assert lib is not None
    fn = lib.function("keel_add_one", [ctypes.c_int], ctypes.c_int)
    assert fn(41) == 42
    assert native.library("adder") is lib
    built = sorted((fresh.parent / "cache" / "native").glob("adder-*.so"))
    assert len(built) == 1
    assert not list((fresh.parent / "cache" / "native").glob(".*"))   # no temporaries left
    stamp = built[0].stat().st_mtime_ns
    native.reset()                           # a new process: found in the cache, not rebuilt
    again = native.library("adder")
    assert again is not None and again.path == built[0]
    assert built[0].stat().st_mtime_ns == stamp
    assert "adder" in native.status().built


def test_changed_source_builds_a_new_library(fresh: Path) -> None:
    _needs_compiler()
    (fresh / "adder.c").write_text(ADD_ONE)
    first = native.library("adder")
    native.reset()
    (fresh / "adder.c").write_text(ADD_ONE.replace("x + 1", "x + 2"))
    second = native.library("adder")
    assert first is not None and second is not None and first.path != second.path
    assert second.function("keel_add_one", [ctypes.c_int], ctypes.c_int)(40) == 42


def test_unknown_function_is_a_clear_error(fresh: Path) -> None:
    _needs_compiler()
    (fresh / "adder.c").write_text(ADD_ONE)
    lib = native.library("adder")
    assert lib is not None
    with pytest.raises(InvalidArgumentError, match="no function 'nope'"):
        lib.function("nope", [])


def test_broken_source_falls_back_and_says_why(fresh: Path) -> None:
    _needs_compiler()
    (fresh / "broken.c").write_text("int oops( {\n")
    assert native.library("broken") is None
    failed = native.status().failed
    assert "broken" in failed and "could not build broken" in failed["broken"]
    assert native.library("broken") is None          # remembered, not rebuilt


def test_missing_source_is_an_error(fresh: Path) -> None:
    _needs_compiler()
    with pytest.raises(InvalidArgumentError, match=r"no native source nothing\.c"):
        native.library("nothing")


def test_keel_native_off_disables(fresh: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KEEL_NATIVE", "off")
    config.reload_settings()
    native.reset()
    (fresh / "adder.c").write_text(ADD_ONE)
    assert native.library("adder") is None
    st = native.status()
    assert not st.available and st.reason == "disabled by KEEL_NATIVE=off" and st.mode == "off"


def test_no_compiler_falls_back_or_fails_when_required(
        fresh: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KEEL_CC", "keel-no-such-compiler")
    config.reload_settings()
    native.reset()
    assert not native.available()
    assert "KEEL_CC='keel-no-such-compiler' is not an executable" in native.status().reason
    monkeypatch.setenv("KEEL_NATIVE", "on")
    config.reload_settings()
    native.reset()
    with pytest.raises(BackendSelectionError, match="keel-no-such-compiler"):
        native.available()


def test_bad_keel_native_value(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KEEL_NATIVE", "sometimes")
    with pytest.raises(InvalidArgumentError,
                       match="KEEL_NATIVE='sometimes' is not allowed; use one of auto, on, off"):
        config.reload_settings()


def test_status_reports_compiler_and_flags(fresh: Path) -> None:
    _needs_compiler()
    st = native.status()
    assert st.available and st.compiler and "-O3" in st.flags
    assert st.to_dict()["compiler"] == st.compiler


@pytest.mark.parametrize(("n", "threads", "min_chunk"),
                         [(0, 4, 1), (1, 4, 1), (7, 2, 1), (10, 3, 1), (10, 8, 4), (5, 1, 1)])
def test_chunks_cover_the_range_in_order(n: int, threads: int, min_chunk: int) -> None:
    parts = pool.chunks(n, threads, min_chunk)
    flat = [i for lo, hi in parts for i in range(lo, hi)]
    assert flat == list(range(n))
    assert len(parts) <= max(1, threads)
    assert all(hi - lo >= min(min_chunk, n) for lo, hi in parts)
    assert pool.chunks(n, threads, min_chunk) == parts


def _pool_check() -> Any:
    lib = native.library("threads")
    if lib is None:
        pytest.skip(f"native tier unavailable: {native.status().reason}")
    return lib.function("keel_pool_check", [ctypes.c_int64] * 3 + [ctypes.c_void_p],
                        ctypes.c_int64)


@pytest.mark.parametrize(("n", "parts"), [(10, 2), (7, 3), (3, 8), (1, 2)])
def test_pool_runs_chunks_of_the_same_split_as_chunks(n: int, parts: int) -> None:
    check = _pool_check()
    out = np.full(3 * min(n, parts), -1, dtype=np.int64)
    assert check(n, parts, 0, out.ctypes.data) == 0
    assert [tuple(r) for r in out.reshape(-1, 3)[:, :2]] == pool.chunks(n, parts)


def test_pool_workers_take_chunks_while_the_caller_runs_its_own() -> None:
    check = _pool_check()
    out = np.full(6, -1, dtype=np.int64)
    assert check(10, 2, 5000, out.ctypes.data) == 0   # each chunk waits for the other
    assert out[2::3].sum() >= 1 and pool.workers() >= 1


@pytest.mark.parametrize(("n", "parts", "threads"), [(16, 8, 2), (9, 9, 3), (5, 8, 1),
                                                     (40, 32, 16), (7, 3, 0)])
def test_a_capped_split_runs_every_chunk_on_at_most_its_threads(n: int, parts: int,
                                                                 threads: int) -> None:
    """keel_parallel_capped: the same chunks as chunks(n, parts), each run once, only by
    threads of the pool's ids below the cap (0: no cap, any of the pool's threads),
    however many workers a wider split started before."""
    lib = native.library("threads")
    if lib is None:
        pytest.skip(f"native tier unavailable: {native.status().reason}")
    capped = lib.function("keel_pool_check_capped", [ctypes.c_int64] * 3 + [ctypes.c_void_p],
                          ctypes.c_int64)
    wide = np.full(3 * 4, -1, dtype=np.int64)
    assert _pool_check()(8, 4, 5000, wide.ctypes.data) == 0      # three workers started
    for _ in range(20):
        out = np.full(3 * min(n, parts), -1, dtype=np.int64)
        assert capped(n, parts, threads, out.ctypes.data) == 0
        rows = out.reshape(-1, 3)
        assert [tuple(r) for r in rows[:, :2]] == pool.chunks(n, parts)
        assert rows[:, 2].min() >= 0
        assert rows[:, 2].max() < (threads or pool.workers() + 1), rows


# The pool's workers started, then the tier reset onto another cache folder (as the tests
# that rebuild do): what is loaded after it runs on the pool mapped first.
ONE_POOL = """
import ctypes, json, os, sys
import numpy as np
from keel import config, native
from keel.native import pool
first = native.library("threads")
check = first.function("keel_pool_check", [ctypes.c_int64] * 3 + [ctypes.c_void_p],
                       ctypes.c_int64)
check(10, 2, 5000, np.full(6, -1, dtype=np.int64).ctypes.data)
started = pool.workers()
os.environ["KEEL_CACHE_DIR"] = sys.argv[1]
config.reload_settings()
native.reset()
again = native.library("threads")
with open("/proc/self/maps") as maps:
    mapped = sorted({line.split()[-1] for line in maps if "/threads-" in line})
print(json.dumps({"same": again is first, "started": started, "workers": pool.workers(),
                  "mapped": mapped}))
"""


@pytest.mark.skipif(not Path("/proc/self/maps").exists(), reason="needs /proc/self/maps")
def test_a_reset_onto_another_cache_keeps_the_one_worker_pool(tmp_path: Path) -> None:
    """One copy of threads.c per process: a second, loaded from another cache folder
    after native.reset(), started a second pool whose workers pin() moved while the
    kernels loaded before ran on the first's."""
    if native.library("threads") is None:
        pytest.skip(f"native tier unavailable: {native.status().reason}")
    done = subprocess.run([sys.executable, "-c", ONE_POOL, str(tmp_path / "cache")],
                          env={**os.environ, "KEEL_NATIVE": "auto",
                               "PYTHONPATH": str(Path(__file__).resolve().parents[2])},
                          timeout=300,
                          capture_output=True, text=True, check=True)
    found = json.loads(done.stdout.strip().splitlines()[-1])
    assert found["started"] >= 1 and found["workers"] == found["started"]
    assert found["same"] and len(found["mapped"]) == 1, found


def test_pool_serves_concurrent_callers_and_restarts_after_shutdown() -> None:
    check = _pool_check()
    results: list[np.ndarray] = []

    def caller() -> None:
        out = np.full(12, -1, dtype=np.int64)
        assert check(40, 4, 0, out.ctypes.data) == 0
        results.append(out)

    threads = [threading.Thread(target=caller) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    want = [lo_hi for lo_hi in pool.chunks(40, 4)]
    assert len(results) == 3
    assert all([tuple(r) for r in out.reshape(-1, 3)[:, :2]] == want for out in results)
    pool.shutdown()
    assert pool.workers() == 0
    out = np.full(6, -1, dtype=np.int64)
    assert check(10, 2, 5000, out.ctypes.data) == 0
    assert pool.workers() >= 1 and out[2::3].sum() >= 1


def test_pool_works_in_a_forked_child() -> None:
    check = _pool_check()
    out = np.full(6, -1, dtype=np.int64)
    check(10, 2, 5000, out.ctypes.data)                 # the parent has a worker now
    pid = os.fork()
    if pid == 0:                                        # the child: its pool starts over
        ok = check(10, 2, 5000, out.ctypes.data) == 0 and out[2::3].sum() >= 1
        os._exit(0 if ok else 1)
    _, status = os.waitpid(pid, 0)
    assert os.WEXITSTATUS(status) == 0


def test_spin_setting_keeps_results() -> None:
    check = _pool_check()
    for us in (0, 50, None):
        pool.set_spin_us(us)
        out = np.full(6, -1, dtype=np.int64)
        assert check(10, 2, 0, out.ctypes.data) == 0
        assert [tuple(r) for r in out.reshape(-1, 3)[:, :2]] == [(0, 5), (5, 10)]


def test_address_matches_numpy_and_never_keeps_an_array_alive() -> None:
    import gc
    import weakref

    import numpy as np

    a = np.arange(12, dtype=np.float32)
    view = a[3:]
    assert native.address(a) == a.ctypes.data
    assert native.address(view) == view.ctypes.data == native.address(view)
    probe = weakref.ref(a)
    del a, view
    gc.collect()
    assert probe() is None
    b = np.ones(5, dtype=np.float64)             # may reuse a freed id: still its own address
    assert native.address(b) == b.ctypes.data


def test_every_native_source_ships_in_the_package() -> None:
    """pyproject's package data must carry every C file and header keel builds from."""
    import fnmatch
    import re

    root = Path(__file__).resolve().parents[2]
    text = (root / "pyproject.toml").read_text()
    line = re.search(r"^\[tool\.setuptools\.package-data\]\s*\nkeel = \[(.*)\]$", text, re.M)
    assert line is not None
    globs = re.findall(r'"([^"]+)"', line.group(1))
    sources = [p.relative_to(root / "keel").as_posix()
               for p in (root / "keel" / "native" / "src").iterdir() if p.suffix in (".c", ".h")]
    assert sources
    assert all(any(fnmatch.fnmatch(s, g) for g in globs) for s in sources), (sources, globs)


@pytest.mark.parametrize(("raw", "shown"), [("", "200"), ("50", "50"), (" 7 ", "7"),
                                            ("0", "0")])
def test_backends_report_the_spin_the_pool_was_given(monkeypatch: pytest.MonkeyPatch, raw: str,
                                                     shown: str) -> None:
    from keel.backends.cpu.backend import CpuBackend

    if not native.available():
        pytest.skip(f"native tier unavailable: {native.status().reason}")
    monkeypatch.setenv("KEEL_SPIN_US", raw)
    config.reload_settings()
    native.reset()                          # loading the pool again hands it KEEL_SPIN_US
    try:
        assert pool.spin_us() == int(shown)
        notes = CpuBackend(threads=2)._capability_details()["notes"]
        assert any(f"spin {shown} us before sleeping" in n for n in notes)
        pool.set_spin_us(3)
        assert pool.spin_us() == 3
        pool.set_spin_us(None)              # back to the setting
        assert pool.spin_us() == int(shown)
    finally:
        monkeypatch.delenv("KEEL_SPIN_US")
        config.reload_settings()
        native.reset()
        pool.set_spin_us(None)


@pytest.mark.parametrize("raw", ["-3", "abc", "1.5"])
def test_a_bad_spin_setting_is_an_error_naming_it(raw: str) -> None:
    with pytest.raises(InvalidArgumentError, match=rf"KEEL_SPIN_US='{raw}' must be a whole "
                                                   r"number >= 0"):
        config.Settings.from_env({"KEEL_SPIN_US": raw})


def test_a_cached_library_loads_without_starting_the_compiler(
        fresh: Path, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    # The compiler's --version answer is remembered beside the builds, keyed by the binary:
    # a later process (the in-process memo cleared) finds everything without running it.
    from keel.native import toolchain

    compiler, _ = find_compiler()
    if compiler is None:
        pytest.skip("no C compiler here")
    log = tmp_path / "calls.log"
    wrapper = tmp_path / "keelcc"
    wrapper.write_text(f'#!/bin/sh\necho "$*" >> {log}\nexec {compiler.path} "$@"\n')
    wrapper.chmod(0o755)
    monkeypatch.setenv("KEEL_CC", str(wrapper))
    config.reload_settings()
    (fresh / "adder.c").write_text(ADD_ONE)

    def new_process() -> list[str]:
        toolchain.compiler_version.cache_clear()
        native.reset()
        before = log.read_text().splitlines() if log.exists() else []
        assert native.library("adder") is not None
        return log.read_text().splitlines()[len(before):]

    first = new_process()
    assert "--version" in first and len(first) >= 2           # asked, then built
    assert new_process() == []                                 # nothing started
    os.utime(wrapper, ns=(0, 0))                               # another compiler binary
    assert new_process() == ["--version"]                      # asked again; builds cached
    toolchain.compiler_version.cache_clear()
    native.reset()


def test_each_chunk_goes_first_to_its_own_thread() -> None:
    """Chunk c runs on the pool's thread c (the caller 0, worker i on i + 1) while every
    thread is free; with the affinity off the chunks are the same, whoever runs them."""
    check = _pool_check()
    try:
        for on in (True, False):
            pool.set_affinity(on)
            pool.shutdown()                       # exactly the workers this split starts
            out = np.full(9, -1, dtype=np.int64)
            assert check(30, 3, 5000, out.ctypes.data) == 0   # every chunk waits for all
            rows = out.reshape(-1, 3)
            assert [tuple(r) for r in rows[:, :2]] == pool.chunks(30, 3)
            assert sorted(rows[:, 2]) == [0, 1, 2]
            if on:
                assert list(rows[:, 2]) == [0, 1, 2]
    finally:
        pool.set_affinity(True)


def test_yielding_and_spinning_threads_run_the_same_chunks() -> None:
    """Spinning threads yield their core every few spins to any thread, only to keel's
    own threads on their CPU, or spin on: the same chunks every way, every one of them
    run, on as many threads as the split asks for (each chunk waits until all have
    started), and a GEMM gives the same bits. Which threads: any of the pool's, not only
    the chunks' owners: a worker left from a wider split earlier in the process takes an
    owned chunk its owner has not claimed yet (an owner descheduled under load)."""
    from keel.backends.cpu import native_gemm
    from keel.backends.cpu.planner import pool_yield

    check = _pool_check()
    rng = np.random.default_rng(3)
    a = rng.standard_normal((64, 300)).astype(np.float32)
    b = rng.standard_normal((300, 200)).astype(np.float32)
    products = []
    ways = ((256, False), (1, True), (200, True), (0, False))
    try:
        for spins, shared in ways:
            pool.set_yield(spins, shared)
            assert pool.yielding() == (256 if spins == 200 else spins, shared)
            out = np.full(12, -1, dtype=np.int64)
            assert check(40, 4, 5000, out.ctypes.data) == 0
            rows = out.reshape(-1, 3)
            assert [tuple(r) for r in rows[:, :2]] == pool.chunks(40, 4)
            ran_on = set(rows[:, 2].tolist())
            assert len(ran_on) == 4 and ran_on <= set(range(pool.workers() + 1))
            c = np.empty((64, 200), np.float32)
            call = native_gemm.prepare(a, b, c)
            assert call is not None
            call.run(3)
            products.append(c.copy())
    finally:
        way = pool_yield()
        pool.set_yield(way.spins, way.shared)
    assert all(p.tobytes() == products[0].tobytes() for p in products)
    np.testing.assert_allclose(products[0], a @ b, rtol=1e-4, atol=1e-3)


def test_the_pool_names_linux_only_calls_only_on_linux(tmp_path: Path) -> None:
    """threads.c as preprocessed for another system (``__linux__`` not defined) calls no
    Linux-only function: sched_getcpu, the affinity and name calls stay behind its
    guard, so the pool builds off Linux."""
    compiler, _ = find_compiler()
    if compiler is None:
        pytest.skip("no C compiler here")
    source = Path(native.__file__).parent / "src" / "threads.c"
    text = subprocess.run(
        [compiler.path, "-E", "-U__linux__", "-U__linux", "-Ulinux", "-U__gnu_linux__",
         str(source)], capture_output=True, text=True, check=True).stdout
    own, mine = [], False
    for line in text.splitlines():         # the lines of threads.c itself, headers left out
        if line.startswith("# "):
            mine = line.split('"')[1] == str(source) if '"' in line else mine
        elif mine:
            own.append(line)
    body = "\n".join(own)
    assert "keel_parallel_capped" in body
    for linux_only in ("sched_getcpu", "pthread_setaffinity_np", "pthread_setname_np",
                       "sched_getaffinity"):
        assert linux_only not in body
