"""Calibration: the crossover sweep on fake backends with exact costs, persistence, selection."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest

from keel import config
from keel.backends.registry import builtin_registry
from keel.dtypes import DType
from keel.errors import InvalidArgumentError
from keel.hardware.profile import HardwareProfile, MemoryInfo
from keel.ops.registry import Op, OpGroup
from keel.planning import calibration as calmod
from keel.planning.calibration import (
    CALIBRATION_VERSION,
    QUICK_SIZES,
    Calibration,
    Measurement,
    cache_dir,
    calibrate,
    calibration_path,
    calibration_status,
    default_calibration,
    find_calibration,
    find_crossover,
    hardware_fingerprint,
    load,
    reset_default_calibration,
    save,
)
from keel.planning.selection import OperationProperties, select_backend
from tests.planning.calibration_fakes import (
    FakeClock,
    copy_model,
    costed_registry,
    cpu_model,
    fake_profile,
    gpu_model,
)

SIZES = (10_000, 31_623, 100_000, 316_228, 1_000_000)


@pytest.fixture(autouse=True)
def _isolated(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Iterator[None]:
    monkeypatch.setenv("KEEL_CACHE_DIR", str(tmp_path / "cache"))
    for var in ("KEEL_CALIBRATION", "KEEL_BACKEND"):
        monkeypatch.delenv(var, raising=False)
    config.settings.cache_clear()
    reset_default_calibration()
    yield
    reset_default_calibration()
    config.settings.cache_clear()


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


def _calibrate(clock: FakeClock, groups: tuple[str, ...] = ("elementwise",),
               **kwargs: object) -> Calibration:
    kwargs.setdefault("registry", costed_registry(clock))
    kwargs.setdefault("sizes", SIZES)
    kwargs.setdefault("repeats", 3)
    kwargs.setdefault("profile", fake_profile())
    return calibrate(groups=groups, clock=clock, **kwargs)  # type: ignore[arg-type]


def _add_costs(nbytes: int) -> tuple[float, float, float]:
    """cpu, gpu with copies, gpu resident for `add` with ``nbytes`` of input (two halves)."""
    half = nbytes // 2
    resident = gpu_model(Op.ADD, nbytes)
    copies = 2 * copy_model(half) + copy_model(half)       # two inputs in, the result out
    return cpu_model(Op.ADD, nbytes), resident + copies, resident


# ---- the sweep -----------------------------------------------------------------------

def test_crossover_is_the_first_size_from_which_the_gpu_stays_ahead(clock: FakeClock) -> None:
    cal = _calibrate(clock)
    # cpu 2 µs + 1 ns/B; gpu 50 µs + 0.16 ns/B with copies: the GPU wins from 57 kB on,
    # so at the measured 100 kB; it led again at 316 kB, so 1 MB was not measured.
    assert cal.crossover_bytes == {(OpGroup.ELEMENTWISE, DType.FLOAT32): 100_000}
    points = cal.measured(OpGroup.ELEMENTWISE, DType.FLOAT32)
    assert [p.nbytes for p in points] == [10_000, 31_616, 100_000, 316_224]
    assert [p.gpu_wins for p in points] == [False, False, True, True]
    assert "the GPU led at 2 consecutive sizes" in cal.notes[0]
    at = cal.evidence(OpGroup.ELEMENTWISE, DType.FLOAT32)
    assert at is not None and at.op is Op.ADD and at.shapes == "12500 + 12500"
    assert (at.cpu_seconds, at.gpu_seconds, at.gpu_resident_seconds) == pytest.approx(
        _add_costs(100_000), rel=1e-9)
    assert at.describe() == "at 100.0 kB float32 add, gpu 66 µs incl. copies vs cpu 102 µs"


def test_clocks_stop_only_after_the_device_synchronized(clock: FakeClock) -> None:
    # The fake GPU queues kernel time until it synchronizes, like a CUDA stream: a
    # resident timing that did not wait would read 0.
    cal = _calibrate(clock, sizes=(10_000,))
    (point,) = cal.measurements
    assert point.gpu_resident_seconds == pytest.approx(gpu_model(Op.ADD, 10_000), rel=1e-9)


def test_find_crossover_needs_the_gpu_ahead_at_every_larger_size() -> None:
    def point(nbytes: int, wins: bool) -> Measurement:
        return Measurement(OpGroup.MATMUL_LIKE, DType.FLOAT32, Op.MATMUL, "", nbytes // 4,
                           nbytes, 1.0, 0.5 if wins else 2.0, 0.1, 3)

    assert find_crossover([point(1, True), point(2, False), point(3, True),
                           point(4, True)]).nbytes == 3  # type: ignore[union-attr]
    assert find_crossover([point(1, True), point(2, True), point(3, False)]) is None
    assert find_crossover([]) is None


def test_a_gpu_that_never_wins_over_the_whole_range_records_none(clock: FakeClock) -> None:
    slow = costed_registry(clock, gpu_cost=lambda op, n: 1e-3 + n * 1e-8)
    cal = _calibrate(clock, registry=slow, sizes=(10_000, 100_000))
    assert cal.covers(OpGroup.ELEMENTWISE, DType.FLOAT32)
    assert cal.crossover(OpGroup.ELEMENTWISE, DType.FLOAT32) is None
    sel = select_backend(OperationProperties(Op.MUL, 10**8, 4 * 10**8, DType.FLOAT32),
                         registry=slow, calibration=cal)
    assert sel.backend == "cpu"
    assert sel.reason.startswith("the GPU was not ahead of the CPU for float32 elementwise ops "
                                 "at the largest size measured (measured ")
    assert "at 100.0 kB float32 add, gpu " in sel.reason


def test_a_sweep_cut_short_before_the_gpu_led_is_inconclusive(clock: FakeClock) -> None:
    cal = _calibrate(clock, budget_seconds=0.0005)
    assert not cal.covers(OpGroup.ELEMENTWISE)
    (note,) = cal.notes
    assert "inconclusive: the GPU was not ahead at 10.0 kB" in note
    assert "would exceed its share of the time budget" in note
    assert "the static rule applies" in note
    assert len(cal.measurements) == 1            # the smallest size is always measured


def test_not_enough_memory_stops_the_sweep(clock: FakeClock) -> None:
    small = HardwareProfile(memory=MemoryInfo(effective_available_bytes=200_000))
    cal = _calibrate(clock, profile=small)
    assert [p.nbytes for p in cal.measurements] == [10_000, 31_616]
    assert "stopped before 100.0 kB: a point needs about 400.0 kB, 200.0 kB is free" \
        in cal.notes[0]


def test_each_dtype_gets_its_own_crossover(clock: FakeClock) -> None:
    reg = costed_registry(clock)
    cal = _calibrate(clock, registry=reg, dtypes=("float32", "float64"))
    assert set(cal.crossover_bytes) == {(OpGroup.ELEMENTWISE, DType.FLOAT32),
                                        (OpGroup.ELEMENTWISE, DType.FLOAT64)}
    assert cal.measured(OpGroup.ELEMENTWISE, "float64")[0].elements == 10_000 // 8
    # float16 was not measured: the static rule decides, and says the calibration had none
    sel = select_backend(OperationProperties(Op.ADD, 10**6, 2 * 10**6, DType.FLOAT16),
                         registry=reg, calibration=cal)
    assert sel.backend == "cpu"
    assert sel.reason.endswith("the GPU pays back the transfer (the calibration has no float16 "
                               "measurement for elementwise ops)")


def test_every_group_has_a_runnable_workload(clock: FakeClock) -> None:
    cal = _calibrate(clock, groups=calmod.DEFAULT_GROUPS, sizes=(10_000, 100_000), repeats=1)
    assert {m.group for m in cal.measurements} == set(calmod.WORKLOADS)
    for m in cal.measurements:
        assert 0.5 * 10_000 <= m.nbytes <= 1.1 * 100_000, m   # near the target size


def test_a_gpu_without_the_op_leaves_its_group_out(clock: FakeClock) -> None:
    reg = costed_registry(clock, gpu_ops=(Op.ADD,))
    cal = _calibrate(clock, groups=("elementwise", "matmul_like"), registry=reg)
    assert cal.covers(OpGroup.ELEMENTWISE) and not cal.covers(OpGroup.MATMUL_LIKE)
    assert "matmul_like float32: not calibrated: no GPU backend (gpu) has a matmul kernel for " \
           "float32" in cal.notes


def test_progress_is_reported_for_every_size(clock: FakeClock) -> None:
    seen: list[tuple[int, int, str]] = []
    _calibrate(clock, progress=lambda done, total, label: seen.append((done, total, label)))
    assert seen[0] == (1, 5, "elementwise float32 10.0 kB")
    assert seen[-1] == (5, 5, "elementwise float32 done")    # the skipped 1 MB counts too


def test_no_gpu_measures_nothing_and_says_why(clock: FakeClock) -> None:
    reg = costed_registry(clock, gpu_available=False)
    cal = _calibrate(clock, registry=reg)
    assert not cal.has_gpu
    assert cal.no_gpu == "gpu: no CUDA device"
    assert cal.crossover_bytes == {} and cal.measurements == ()
    assert clock.now == 0.0                                  # nothing was timed
    assert reg.instance("cpu").kernel_calls == 0             # type: ignore[attr-defined]
    sel = select_backend(OperationProperties(Op.MATMUL, 10, 40, DType.FLOAT32), registry=reg,
                         calibration=cal)
    assert sel.reason == "the CPU is the only device available for it"
    # a GPU usable later (CuPy installed since) meets the static rule and a hint
    later = costed_registry(clock)
    sel = select_backend(OperationProperties(Op.MATMUL, 10**7, 4 * 10**7, DType.FLOAT32),
                         registry=later, calibration=cal)
    assert sel.backend == "gpu" and sel.reason.endswith(
        "where the GPU pays back the transfer (the calibration found no usable GPU; run "
        "`keel calibrate` again)")


@pytest.mark.parametrize(("kwargs", "match"), [
    ({"groups": ("matmul",)}, r"unknown op group 'matmul'; allowed: "),
    ({"groups": ("shape",)}, r"cannot calibrate op group\(s\) \['shape'\]; allowed: "
                             r"elementwise, reduction, matmul_like"),
    ({"sizes": (0, 10)}, r"sizes must be positive ints of bytes, got \[0, 10\]"),
    ({"budget_seconds": -1}, r"budget_seconds must be a positive number, got -1"),
    ({"repeats": 0}, r"repeats must be a positive number, got 0"),
    ({"dtypes": ("string",)}, r"dtypes must name at least one numeric dtype"),
])
def test_bad_arguments_say_what_is_allowed(clock: FakeClock, kwargs: dict[str, object],
                                           match: str) -> None:
    with pytest.raises(InvalidArgumentError, match=match):
        _calibrate(clock, **kwargs)  # type: ignore[arg-type]


# ---- persistence --------------------------------------------------------------------

def test_save_and_load_round_trip(clock: FakeClock, tmp_path: Path) -> None:
    cal = _calibrate(clock, dtypes=("float32", "float64"))
    path = save(cal, tmp_path / "out" / "cal.json")
    data = json.loads(path.read_text())
    assert (data["format"], data["version"]) == ("keel-calibration", CALIBRATION_VERSION)
    assert data["crossover_bytes"]["elementwise/float32"] == 100_000
    assert load(path) == cal
    assert load(path, hardware_fingerprint(fake_profile())) == cal
    assert [p.name for p in path.parent.iterdir()] == ["cal.json"]   # no temporary left over


def test_the_cache_keeps_one_file_per_machine(clock: FakeClock, tmp_path: Path) -> None:
    cal = _calibrate(clock)
    path = save(cal)
    assert path.parent == tmp_path / "cache"
    assert path == calibration_path(hardware_fingerprint(fake_profile()))
    status = find_calibration(profile=fake_profile())
    assert status.calibration == cal and status.path == str(path)
    assert status.reason.startswith(f"loaded {path} (measured ")
    other = find_calibration(profile=fake_profile(gpu="Other GPU"))
    assert other.calibration is None
    assert other.reason == f"the 1 calibration(s) cached in {path.parent} are for other " \
                           "machines; run `keel calibrate` here"


def test_a_file_from_a_different_machine_is_ignored_with_the_reason(
        clock: FakeClock, tmp_path: Path) -> None:
    path = save(_calibrate(clock), tmp_path / "cal.json")
    here = fake_profile(cpu="Other CPU", driver="560.0")
    status = find_calibration(path, profile=here)
    assert status.calibration is None and status.path == str(path)
    assert status.reason == (
        f"ignored: calibration {str(path)!r} was measured on a different machine (cpu: "
        f"'Fake CPU 9000' in the file, 'Other CPU' here; gpus: [{{'name': 'Fake GPU', "
        f"'driver': '550.1', 'memory_bytes': 85899345920}}] in the file, [{{'name': "
        f"'Fake GPU', 'driver': '560.0', 'memory_bytes': 85899345920}}] here): run "
        f"`keel calibrate` here")
    with pytest.raises(InvalidArgumentError, match=r"measured on a different machine \(cpu: "):
        load(path, hardware_fingerprint(here))


@pytest.mark.parametrize(("content", "reason"), [
    ("{not json", "is not valid JSON"),
    ('{"crossover_bytes": {}}', 'is not a keel calibration file (no "format": '
                                '"keel-calibration")'),
    ('{"format": "keel-calibration", "version": 99}',
     "has format version 99; this keel reads version 1: run `keel calibrate` again"),
    ('{"format": "keel-calibration", "version": 1, "crossover_bytes": {"elementwise": -5}}',
     "crossover for elementwise must be a non-negative int of bytes or None, got -5"),
    ('{"format": "keel-calibration", "version": 1, "measurements": [{"group": "reduction"}]}',
     "a measurement lacks 'dtype'"),
])
def test_broken_files_are_ignored_with_the_reason(tmp_path: Path, content: str,
                                                  reason: str) -> None:
    path = tmp_path / "cal.json"
    path.write_text(content)
    status = find_calibration(path, profile=fake_profile())
    assert status.calibration is None
    assert status.reason.startswith("ignored: ") and reason in status.reason


def test_a_hand_written_file_is_not_tied_to_a_machine(tmp_path: Path) -> None:
    path = tmp_path / "fleet.json"
    path.write_text('{"format": "keel-calibration", "version": 1, "source": "fleet policy", '
                    '"crossover_bytes": {"matmul_like": 2000000}}')
    status = find_calibration(path, profile=fake_profile())
    assert status.calibration == Calibration({"matmul_like": 2_000_000}, source="fleet policy")


def test_missing_file_and_calibration_off(monkeypatch: pytest.MonkeyPatch,
                                          tmp_path: Path) -> None:
    status = find_calibration(tmp_path / "nope.json", profile=fake_profile())
    assert status.calibration is None and "cannot read calibration" in status.reason
    assert find_calibration(profile=fake_profile()).reason == (
        f"no calibration cached in {tmp_path / 'cache'}; run `keel calibrate` to measure "
        "this machine")
    monkeypatch.setenv("KEEL_CALIBRATION", "off")
    config.reload_settings()
    assert find_calibration().reason == "KEEL_CALIBRATION=off: calibration is off; the static " \
                                        "thresholds apply"


def test_cache_dir_follows_the_platform(tmp_path: Path) -> None:
    home = str(tmp_path)
    assert cache_dir({"KEEL_CACHE_DIR": "/x/y"}) == Path("/x/y")
    assert cache_dir({"HOME": home}, "Linux") == tmp_path / ".cache" / "keel"
    assert cache_dir({"HOME": home, "XDG_CACHE_HOME": "/xdg"}, "Linux") == Path("/xdg/keel")
    assert cache_dir({"HOME": home}, "Darwin") == tmp_path / "Library" / "Caches" / "keel"
    assert cache_dir({"HOME": home, "LOCALAPPDATA": "/la"}, "Windows") == \
        Path("/la") / "keel" / "Cache"


def test_calibration_from_dict_validates() -> None:
    with pytest.raises(InvalidArgumentError, match=r"measurements and notes must be lists"):
        Calibration.from_dict({"crossover_bytes": {}, "measurements": {"a": 1}})
    with pytest.raises(InvalidArgumentError, match=r"cpu_seconds must be a non-negative number"):
        Measurement.from_dict({"group": "elementwise", "dtype": "float32", "op": "add",
                               "shapes": "", "elements": 1, "nbytes": 4, "cpu_seconds": -1,
                               "gpu_seconds": 1, "gpu_resident_seconds": 1, "repeats": 1})
    with pytest.raises(InvalidArgumentError, match=r"unknown dtype|dtype"):
        Calibration({"elementwise/float99": 1})


# ---- selection uses it ------------------------------------------------------------------

def test_selection_uses_the_cached_calibration_and_quotes_it(clock: FakeClock) -> None:
    reg = costed_registry(clock)
    # measured on this machine (the real probe), so the cached file is this machine's
    cal = _calibrate(clock, registry=reg, profile=None)
    save(cal)
    assert default_calibration() == cal
    assert calibration_status().reason.startswith("loaded ")
    big = OperationProperties(Op.MUL, 50_000, 200_000, DType.FLOAT32)
    sel = select_backend(big, registry=reg)
    assert sel.backend == "gpu"
    assert sel.reason == (
        f"200.0 kB of float32 elementwise input is at or over the measured GPU crossover "
        f"100.0 kB ({cal.source}: at 100.0 kB float32 add, gpu 66 µs incl. copies vs cpu "
        f"102 µs)")
    small = OperationProperties(Op.MUL, 5_000, 20_000, DType.FLOAT32)
    assert select_backend(small, registry=reg).backend == "cpu"
    # a pin stays authoritative; an empty calibration keeps the static rules
    assert select_backend(small, registry=reg, pinned="gpu").reason == "pinned by the caller"
    assert select_backend(big, registry=reg, calibration=Calibration()).reason.startswith(
        "200.0 kB of input is under 1 MB")


def test_a_stale_cached_file_leaves_selection_on_the_static_rules(
        clock: FakeClock, monkeypatch: pytest.MonkeyPatch, tmp_path: Path,
        caplog: pytest.LogCaptureFixture) -> None:
    reg = costed_registry(clock)
    path = save(_calibrate(clock, registry=reg, profile=fake_profile(cpu="Elsewhere")),
                tmp_path / "elsewhere.json")
    monkeypatch.setenv("KEEL_CALIBRATION", str(path))
    config.reload_settings()
    with caplog.at_level("WARNING", logger="keel.planning.calibration"):
        assert default_calibration() is None
    assert "measured on a different machine" in calibration_status().reason
    assert [r.name for r in caplog.records] == ["keel.planning.calibration"]  # as documented
    sel = select_backend(OperationProperties(Op.MUL, 50_000, 200_000, DType.FLOAT32),
                         registry=reg)
    assert sel.backend == "cpu" and "under 1 MB" in sel.reason


# ---- the real thing ---------------------------------------------------------------------

def _gpu_unavailable() -> str | None:
    avail = builtin_registry().availability("gpu")
    return None if avail.available else avail.reason


@pytest.mark.gpu
def test_real_sweep_on_cupy(tmp_path: Path) -> None:
    why = _gpu_unavailable()
    if why is not None:
        pytest.skip(f"the gpu backend is unavailable: {why}")
    reg = builtin_registry()
    cal = calibrate(reg, groups=("elementwise", "matmul_like"), sizes=QUICK_SIZES, repeats=3,
                    budget_seconds=60)
    assert cal.has_gpu and cal.devices["gpu"].startswith("gpu: CuPy ")
    assert {m.group for m in cal.measurements} == {OpGroup.ELEMENTWISE, OpGroup.MATMUL_LIKE}
    for m in cal.measurements:
        assert m.cpu_seconds > 0 and m.gpu_seconds > 0 and m.gpu_resident_seconds > 0, m
    for group in (OpGroup.ELEMENTWISE, OpGroup.MATMUL_LIKE):
        if cal.covers(group, DType.FLOAT32):   # decided: consistent with its own points
            found = find_crossover(cal.measured(group, DType.FLOAT32))
            assert cal.crossover(group, DType.FLOAT32) == (None if found is None
                                                           else found.nbytes)
    assert load(save(cal, tmp_path / "gpu.json"), hardware_fingerprint()) == cal
