"""The least work a thread per machine (backends/cpu/thread_costs.py, the cpu planner's
least_work): the declared values where nothing is measured, a real measurement of this
machine within sane ranges, the derivation rule feeding the splits, the cache file
(ignored with a reason when damaged or foreign), the plan's note, and results bitwise the
same across thread counts under measured values."""

from __future__ import annotations

import json
import re
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from keel import config, native
from keel.backends.cpu import fastmath, thread_costs
from keel.backends.cpu import native_gemm as ng
from keel.backends.cpu import planner as cpu_planner
from keel.backends.cpu.backend import CpuBackend, default_threads
from keel.errors import InvalidArgumentError
from keel.native import pool

LeastWork = cpu_planner.LeastWork
Family = thread_costs.Family


@pytest.fixture(autouse=True)
def _fresh_costs() -> Iterator[None]:
    """No thread costs kept or remembered from another test, before or after."""
    def clear() -> None:
        path = thread_costs.path_here()
        if path.exists():
            path.unlink()
        thread_costs.forget()
        cpu_planner.forget()

    clear()
    yield
    clear()


def _mode(monkeypatch: pytest.MonkeyPatch, mode: str) -> None:
    monkeypatch.setenv("KEEL_THREAD_COSTS", mode)
    config.reload_settings()
    thread_costs.forget()


def _needs_native() -> None:
    if not native.available():
        pytest.skip(f"native tier unavailable: {native.status().reason}")


def _costs(dispatch: dict[int, float], rate_scale: float = 1.0) -> thread_costs.ThreadCosts:
    """Costs as a machine would measure them: ``dispatch`` (us by threads) and every
    family ``rate_scale`` times the reference rate."""
    def sample(v: float) -> thread_costs.Sample:
        return thread_costs.Sample(v, v, v, 9)

    return thread_costs.ThreadCosts(
        tuple((t, sample(us)) for t, us in sorted(dispatch.items())),
        tuple((f, sample(cpu_planner.THREAD_COST_REFERENCE_RATES[f] * rate_scale))
              for f in Family), "a test machine", max(dispatch), 0.1)


REF_US = cpu_planner.THREAD_COST_REFERENCE_DISPATCH_US


# ---- declared -------------------------------------------------------------------------
def test_off_gives_the_declared_values_and_the_splits_of_before(
        monkeypatch: pytest.MonkeyPatch) -> None:
    _mode(monkeypatch, "off")
    assert thread_costs.current().costs is None
    for work in LeastWork.ALL:
        for threads in (1, 2, 3, 16):
            assert cpu_planner.least_work(work, threads) == work.declared
    least = cpu_planner.MIN_FLOPS_PER_THREAD
    for threads in (1, 2, 3, 4, 16):
        for flops in (0, least - 1, least, 2 * least - 1, 2 * least, 5 * least + 7, 99 * least):
            assert cpu_planner.gemm_threads(threads, flops) == min(threads, flops // least)
    note = cpu_planner.thread_costs_note(2)
    assert note.startswith("least work a thread: declared") and "KEEL_THREAD_COSTS=off" in note


def test_a_lowered_constant_still_lowers_the_least_work(
        monkeypatch: pytest.MonkeyPatch) -> None:
    # The kernels' split tests lower the constants: the declared value is read when asked.
    monkeypatch.setattr(cpu_planner, "MIN_CHUNK_TAPS", 1)
    assert cpu_planner.least_work(LeastWork.TAPS, 16) == 1


def test_auto_measures_only_on_more_than_two_cores(monkeypatch: pytest.MonkeyPatch) -> None:
    _needs_native()
    _mode(monkeypatch, "auto")
    source = thread_costs.current()
    if default_threads() <= 2:
        assert source.costs is None
        assert f"{default_threads()} usable cores" in source.reason
        assert not thread_costs.path_here().exists()
    else:
        assert source.costs is not None and thread_costs.path_here().exists()


def test_a_bad_setting_is_refused() -> None:
    with pytest.raises(InvalidArgumentError, match="KEEL_THREAD_COSTS='sometimes'"):
        config.Settings.from_env({"KEEL_THREAD_COSTS": "sometimes"})


# ---- a real measurement ------------------------------------------------------------------
def test_the_pool_times_its_dispatch() -> None:
    _needs_native()
    found = pool.dispatch_times(2, 20)
    assert found is not None and not found.busy and len(found.times) == 20
    assert all(0 < t < 1_000_000_000 for t in found.times) and 0 <= found.stalled <= 20
    assert pool.dispatch_times(1, 5) is None             # no split on one thread


def test_a_measurement_here_is_sane_kept_and_read_back(monkeypatch: pytest.MonkeyPatch) -> None:
    _needs_native()
    _mode(monkeypatch, "on")
    source = thread_costs.current()
    costs = source.costs
    assert costs is not None, source.reason
    assert "measured on this machine just now" in source.reason
    assert [t for t, _ in costs.dispatch_us] == sorted(
        {t for t in (2, 4, 8, default_threads()) if 2 <= t <= default_threads()})
    for _, s in costs.dispatch_us:
        assert 0.01 < s.low <= s.median <= s.high < 20_000 and s.count >= 9
    sane = {Family.GEMM: (1, 10_000), Family.WINDOW: (0.1, 1_000),
            Family.FASTMATH: (0.01, 100), Family.COPY: (0.01, 100),
            Family.WINOGRAD: (0.01, 1_000)}
    for family, (lo, hi) in sane.items():
        assert lo < costs.rate(family) < hi, (family, costs.rate(family))
    assert costs.seconds < 5
    for work in LeastWork.ALL:
        value = cpu_planner.least_work(work, 2)
        limit = cpu_planner.THREAD_COST_SCALE_LIMIT
        assert work.declared / limit - 1 <= value <= work.declared * limit + 1
        assert value == max(1, round(work.declared * cpu_planner.cost_scale(
            costs, work.family, 2)))
    if costs.doubt:                          # a loaded machine: used here, not kept
        assert "this process only" in source.reason and not thread_costs.path_here().exists()
        return
    thread_costs.forget()                    # another process: read from the file
    again = thread_costs.current()
    assert again.costs == costs and again.reason.startswith("measured on this machine (loaded")
    note = cpu_planner.thread_costs_note(2)
    assert "dispatch" in note and "us on 2 threads" in note and "flops/ns" in note


# ---- the rule, on given costs ------------------------------------------------------------
def test_the_rule_scales_the_declared_value_and_feeds_the_splits(
        monkeypatch: pytest.MonkeyPatch) -> None:
    _mode(monkeypatch, "auto")
    # A pool twice as slow to dispatch on 2 threads, four times on 4, rates as here.
    thread_costs.save(_costs({2: 2 * REF_US, 4: 4 * REF_US}))
    thread_costs.forget()
    least = cpu_planner.MIN_FLOPS_PER_THREAD
    assert cpu_planner.least_work(LeastWork.FLOPS, 2) == 2 * least
    assert cpu_planner.least_work(LeastWork.FLOPS, 3) == 4 * least   # the next point up
    assert cpu_planner.least_work(LeastWork.FLOPS, 16) == 4 * least  # the widest measured
    assert cpu_planner.gemm_threads(2, 3 * least) == 1               # declared: 2
    assert cpu_planner.gemm_threads(4, 5 * least) == 2               # declared: 4
    assert cpu_planner.gemm_threads(4, 16 * least) == 4
    # B packed per call (raw): its flops decide, not the floats of a kept B it streams.
    split = cpu_planner.gemm_split(1, 1, 512, 784, 2, raw=(True, True))
    assert split.parts == 1 and f"under {2 * least:,}" in split.reason
    floats = cpu_planner.least_work(LeastWork.STREAM, 2)
    assert floats == 2 * cpu_planner.MIN_STREAM_FLOATS
    # A kept B it streams: its floats against the scaled least work of a streaming pass.
    depth = 2 * floats // 256                        # 2 x least floats of a 256-column B
    assert cpu_planner.gemm_split(1, 1, 256, depth - 1, 2).parts == 1
    assert cpu_planner.gemm_split(1, 1, 256, depth, 2).parts == 2
    table = cpu_planner.least_work_table(4)
    assert table["least_work"]["MIN_FLOPS_PER_THREAD"]["4 threads"] == 4 * least


def test_faster_cores_ask_more_work_and_the_scale_is_held(
        monkeypatch: pytest.MonkeyPatch) -> None:
    _mode(monkeypatch, "auto")
    thread_costs.save(_costs({2: REF_US}, rate_scale=3.0))
    thread_costs.forget()
    for work in LeastWork.ALL:
        assert cpu_planner.least_work(work, 2) == round(3 * work.declared)
    thread_costs.save(_costs({2: 1000 * REF_US}))          # a clock gone wrong
    thread_costs.forget()
    assert cpu_planner.least_work(LeastWork.TAPS, 2) == round(
        cpu_planner.THREAD_COST_SCALE_LIMIT * cpu_planner.MIN_CHUNK_TAPS)


def _write(text: str) -> None:
    path = thread_costs.path_here()
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    thread_costs.forget()


def test_a_damaged_or_foreign_file_is_ignored_with_a_reason(
        monkeypatch: pytest.MonkeyPatch) -> None:
    _mode(monkeypatch, "auto")
    _write("{ not json")
    assert thread_costs.load() == (None, thread_costs.load()[1])
    assert "unreadable" in thread_costs.load()[1]
    path = thread_costs.save(_costs({2: REF_US}))
    good = json.loads(path.read_text())
    cases = {"another machine": {**good, "fingerprint": {"cpu": "elsewhere"}},
             "this is keel": {**good, "keel": "0.0.0"},
             "not a keel thread-costs file": {**good, "format": "something"},
             "damaged": {**good, "costs": {**good["costs"], "rates_per_ns": {}}}}
    for why, data in cases.items():
        _write(json.dumps(data))
        costs, reason = thread_costs.load()
        assert costs is None and why in reason and str(path) in reason
        source = thread_costs.current()
        if default_threads() <= 2:              # not measured again here: the reason says why
            assert source.costs is None and why in source.reason
    _write(json.dumps(good))
    assert thread_costs.current().costs == _costs({2: REF_US})


def test_the_plan_notes_say_where_the_least_work_comes_from(
        monkeypatch: pytest.MonkeyPatch) -> None:
    _mode(monkeypatch, "auto")
    notes = CpuBackend(threads=2).plan_notes()
    assert any(n.startswith("least work a thread: ") for n in notes)
    thread_costs.save(_costs({2: 2 * REF_US}))
    thread_costs.forget()
    note = next(n for n in CpuBackend(threads=2).plan_notes() if n.startswith("least work"))
    assert "measured on this machine" in note
    assert f"{2 * cpu_planner.MIN_FLOPS_PER_THREAD:,} flops" in note


# ---- the same bits whatever the split -----------------------------------------------------
def test_results_do_not_depend_on_the_split_under_measured_costs(
        monkeypatch: pytest.MonkeyPatch) -> None:
    _needs_native()
    _mode(monkeypatch, "auto")
    # A pool 16 times cheaper than here: the least work a sixteenth, so small calls split.
    thread_costs.save(_costs({2: REF_US / 16}))
    thread_costs.forget()
    rng = np.random.default_rng(3)
    a = rng.standard_normal((37, 300), dtype=np.float32)
    b = rng.standard_normal((300, 129), dtype=np.float32)
    x = rng.standard_normal(50_001, dtype=np.float32)
    products, gelus = [], []
    for threads in (1, 2, 3, 16):
        c = np.empty((37, 129), np.float32)
        assert ng.gemm(a, b, c, threads=threads)
        products.append(c)
        y = np.empty_like(x)
        assert fastmath.unary("gelu", x, y, threads=threads)
        gelus.append(y)
    assert cpu_planner.gemm_threads(16, 2 * 37 * 300 * 129) > 2
    for got in products[1:]:
        np.testing.assert_array_equal(got, products[0])
    for got in gelus[1:]:
        np.testing.assert_array_equal(got, gelus[0])


def test_the_winograd_pipeline_is_planned_again_under_other_costs(
        monkeypatch: pytest.MonkeyPatch) -> None:
    # Its pieces come from gemm_threads: remembered per thread costs, as gemm_split is.
    _mode(monkeypatch, "auto")
    sizes = cpu_planner.Caches(2 << 20, 32 << 20, "given")
    args = (1, 64, 64, (14, 14), 2, sizes, (8, 32))
    thread_costs.save(_costs({2: REF_US / 8}))            # cheap dispatch: split
    thread_costs.forget()
    cheap = cpu_planner.winograd_pipeline(*args)
    thread_costs.save(_costs({2: 16 * REF_US}))           # dear dispatch: one piece
    thread_costs.forget()
    dear = cpu_planner.winograd_pipeline(*args)
    assert (cheap.parts, dear.parts) == (2, 1), (cheap, dear)


def _pool_held_by_another_thread() -> tuple[threading.Event, threading.Thread]:
    """A thread running two-thread products on the pool until the event is set."""
    rng = np.random.default_rng(1)
    a = rng.standard_normal((256, 256), dtype=np.float32)
    b = ng.pack(rng.standard_normal((256, 256), dtype=np.float32), left=False)
    c = np.empty((256, 256), np.float32)
    stop = threading.Event()

    def loop() -> None:
        while not stop.is_set():
            ng.gemm(a, b, c, threads=2)

    worker = threading.Thread(target=loop)
    worker.start()
    return stop, worker


def test_a_busy_pool_times_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    # Another thread's jobs on the pool: a timing job then runs inline (each chunk waiting
    # out its millisecond); it says so instead of giving that as the dispatch.
    _needs_native()
    _mode(monkeypatch, "off")
    monkeypatch.setattr(thread_costs, "BUSY_TRIES", 1)
    stop, worker = _pool_held_by_another_thread()
    try:
        until = time.monotonic() + 20
        busy = None
        while busy is None and time.monotonic() < until:     # until a job finds it held
            found = pool.dispatch_times(2, 50)
            busy = found if found is not None and found.busy else None
        refused = ""
        while not refused and time.monotonic() < until + 20:
            try:
                thread_costs.measure(2)
            except thread_costs.PoolBusy as exc:
                refused = str(exc)
    finally:
        stop.set()
        worker.join()
    assert busy is not None and not busy.times and busy.stalled == 0
    assert "another thread's job" in refused


def test_a_busy_pool_is_measured_again_on_the_next_plan(
        monkeypatch: pytest.MonkeyPatch) -> None:
    _mode(monkeypatch, "on")
    tries = []

    def busy(cores: int, cpu: str) -> thread_costs.ThreadCosts:
        tries.append(cores)
        raise thread_costs.PoolBusy("keel's pool was running another thread's job")

    monkeypatch.setattr(thread_costs, "measure", busy)
    source = thread_costs.current()
    assert source.costs is None and source.again and "another thread's job" in source.reason
    thread_costs.current()
    assert len(tries) == 2 and not thread_costs.path_here().exists()


def test_a_contended_timing_is_used_by_this_process_only(
        monkeypatch: pytest.MonkeyPatch) -> None:
    _mode(monkeypatch, "on")
    quiet = thread_costs.Sample(0.8, 0.7, 0.9, 200)
    assert thread_costs.contention([(2, quiet), (4, thread_costs.Sample(1.2, 1, 1.4, 200))],
                                   [0, 0]) == ""
    assert "stalled" in thread_costs.contention([(2, quiet)], [30])
    assert "quartiles" in thread_costs.contention([(2, thread_costs.Sample(1, 0.7, 7, 200))],
                                                  [0])
    assert "load average 5.0 on 2" in thread_costs.contention([(2, quiet)], [0], 5.0, 2)
    assert thread_costs.contention([(2, quiet)], [0], 1.5, 2) == ""
    assert "on 4 threads against" in thread_costs.contention(
        [(2, quiet), (4, thread_costs.Sample(7, 6.9, 7.1, 200))], [0, 0])
    contended = _costs({2: 9 * REF_US})
    contended = thread_costs.ThreadCosts(contended.dispatch_us, contended.rates, "here", 2,
                                         0.1, "8 of 200 jobs on 2 threads stalled")
    monkeypatch.setattr(thread_costs, "measure", lambda cores, cpu: contended)
    source = thread_costs.current()
    assert source.costs == contended and "this process only" in source.reason
    assert not thread_costs.path_here().exists()
    assert "this process only" in cpu_planner.thread_costs_note(2)


def test_a_measurement_that_fails_leaves_no_placeholder(
        monkeypatch: pytest.MonkeyPatch) -> None:
    _mode(monkeypatch, "on")

    def broken(cores: int, cpu: str) -> thread_costs.ThreadCosts:
        raise OSError("no such device")

    monkeypatch.setattr(thread_costs, "measure", broken)
    source = thread_costs.current()
    assert source.costs is None and "no such device" in source.reason
    assert thread_costs.current() is source                    # kept: not measured again


def test_a_reason_names_the_constant_only_for_its_declared_value(
        monkeypatch: pytest.MonkeyPatch) -> None:
    _mode(monkeypatch, "auto")
    least = cpu_planner.MIN_FLOPS_PER_THREAD
    thread_costs.save(_costs({2: REF_US}))
    thread_costs.forget()
    assert cpu_planner.least_named(LeastWork.FLOPS, 2) == f"MIN_FLOPS_PER_THREAD = {least:,}"
    thread_costs.save(_costs({2: 2 * REF_US}))
    thread_costs.forget()
    assert cpu_planner.least_named(LeastWork.FLOPS, 2) == (
        f"least work (MIN_FLOPS_PER_THREAD, scaled to this machine's costs) = {2 * least:,}")
    # No reason prints a derived least work under the constant's bare name.
    pattern = re.compile("(" + "|".join(w.constant for w in LeastWork.ALL) + r") = \{")
    for path in Path(cpu_planner.__file__).parent.glob("*.py"):
        assert not pattern.search(path.read_text()), path


def test_the_table_has_one_entry_a_width_and_the_cli_refuses_yaml() -> None:
    from typer.testing import CliRunner

    from keel.cli import app

    assert list(cpu_planner.least_work_table(2)["least_work"]["MIN_CHUNK_TAPS"]) == [
        "unit", "declared", "2 threads"]
    assert list(cpu_planner.least_work_table(4)["least_work"]["MIN_CHUNK_TAPS"])[-2:] == [
        "2 threads", "4 threads"]
    result = CliRunner().invoke(app, ["probe", "--thread-costs", "--yaml"])
    assert result.exit_code != 0 and "--yaml" in str(result.exception or result.output)


def test_every_family_splits_by_the_least_work_at_each_width(
        monkeypatch: pytest.MonkeyPatch) -> None:
    # A dispatch four times dearer on 4 threads: work for 2 threads at their least is
    # split over 2, not left on one because 4 would each get too little.
    _mode(monkeypatch, "auto")
    thread_costs.save(_costs({2: REF_US, 4: 4 * REF_US}))
    thread_costs.forget()
    per_plane = cpu_planner.winograd_plane_floats((14, 14), False)
    planes = 4 * cpu_planner.MIN_CHUNK_FLOATS // per_plane + 1
    assert cpu_planner.winograd_transform_parts(planes, (14, 14), False, 4) == 2


# ---- every split asks the least work of its own width ------------------------------------
def _wider_costs(monkeypatch: pytest.MonkeyPatch) -> None:
    """Costs where a split over 2 threads asks the declared least work and one over 4 (or
    3: the next point measured) four times it."""
    _mode(monkeypatch, "auto")
    thread_costs.save(_costs({2: REF_US, 4: 4 * REF_US}))
    thread_costs.forget()


def _full_width(work: LeastWork, items: int, per_item: int) -> int:
    """What the splits gave when they asked the least work of all 4 threads."""
    return pool.parts(items, 4, max(1, cpu_planner.least_work(work, 4) // per_item))


@pytest.mark.parametrize(("work", "items", "per_item"), [
    (LeastWork.FLOPS, 12, cpu_planner.MIN_FLOPS_PER_THREAD // 4),
    (LeastWork.TAPS, 172, 576),
    (LeastWork.COPY, 512, 384),
    (LeastWork.FLOATS, 12, cpu_planner.MIN_CHUNK_FLOATS // 4),
    (LeastWork.ELEMENTS, 6, 4096)])
def test_split_parts_takes_the_widest_split_its_work_pays_for(
        work: LeastWork, items: int, per_item: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """Work for 2 threads at their least, not for 4 at theirs: 2 chunks on 4 threads (the
    full-width least work left it on one); declared, the same count as pool.parts."""
    assert cpu_planner.split_parts(work, 4, items, per_item) == pool.parts(
        items, 4, max(1, work.declared // per_item))
    _wider_costs(monkeypatch)
    assert _full_width(work, items, per_item) == 1
    assert cpu_planner.split_parts(work, 4, items, per_item) == 2
    assert cpu_planner.split_parts(work, 4, 16 * items, per_item) == 4  # pays for 4 there
    assert cpu_planner.split_parts(work, 4, 0, per_item) == 0
    assert cpu_planner.chunk_split("planes", items, 4, items * per_item, work).pieces == 2


def test_the_int8_splits_ask_the_least_work_of_their_width(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The int8 products (qgemm.c's matrix product and direct conv, qlayout.c's panels)
    and the channels-last depthwise sums: 12 tasks of a quarter of the least work each."""
    flops_task = cpu_planner.MIN_FLOPS_PER_THREAD // 4 - 160     # 99,840: whole tiles
    _wider_costs(monkeypatch)
    assert _full_width(LeastWork.FLOPS, 12, flops_task) == 1
    rows, panel = cpu_planner.INT8_MATMUL_ROWS, cpu_planner.INT8_DIRECT_PANEL
    assert 2 * rows * panel * 130 == flops_task
    assert cpu_planner.int8_matmul_split(4 * rows, 130, 3 * panel, 4).parts == 2
    assert cpu_planner.int8_direct_split(12, 1, panel, 780, 1, panel, 4).parts == 2
    pixels = cpu_planner.INT8_TILE_PIXELS
    assert 2 * pixels * 130 * 32 == flops_task
    assert cpu_planner.int8_panel_split(12 * pixels, 130, 32, 4).parts == 2
    # 12 output rows of 25 pixels x 50 channels x 10 taps: a quarter of MIN_CHUNK_TAPS.
    assert _full_width(LeastWork.TAPS, 12, 12_500) == 1
    assert cpu_planner.int8_depthwise_split(1, 50, 12, 25, 10, 1, 4, False).parts == 2


def test_the_window_copy_and_row_kernels_ask_the_least_work_of_their_width(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The bound calls of window.c (a depthwise window's planes, a global pool's, the
    strided copy), fastmath.c's row attention and a Transpose node's threads."""
    _needs_native()
    from keel.backends.cpu import native_window as nw
    from keel.backends.cpu.backend import CpuBackend as Backend
    from keel.dtypes import DType
    from keel.ops.registry import Op
    from keel.ops.schemas.conv import Window
    from keel.ops.types import TensorType

    _wider_costs(monkeypatch)
    geo = nw.plan(172, Window((8, 8), (3, 3), (1, 1), (1, 1), (1, 1), (1, 1), (8, 8)))
    assert geo is not None and geo.taps_per_plane == 576
    assert geo.parts(172, 4) == 2
    x = np.ones((1, 30, 50, 100), np.float32)              # 3 x MIN_CHUNK_TAPS
    assert _full_width(LeastWork.TAPS, 30, 5000) == 1
    assert nw.bind_global_max_pool(x, np.empty((1, 30, 1, 1), np.float32), 4).args[-1] == 2
    a = np.ones((384, 512), np.float32)                     # 3 x MIN_COPY_ELEMENTS
    call = nw.bind_strided_copy(a.T, np.empty((512, 384), np.float32), 4)
    assert call is not None and call.args[-1] == 2
    attention = fastmath.row_attention((6, 16, 8), (6, 16, 8), (6, 16, 8), None, 1.0, False,
                                       threads=4)          # 6 heads of 4,096 elements
    assert attention is not None and attention.parts == 2
    plan = Backend(threads=4).plan_node(
        Op.TRANSPOSE, [TensorType(DType.FLOAT32, (384, 512))], {"perm": (1, 0)})
    assert plan.threads == 2
    assert f"at least {cpu_planner.MIN_COPY_ELEMENTS:,} per thread" in plan.reason("threads")
