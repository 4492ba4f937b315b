"""One place for settings: every ``KEEL_*`` variable is read, validated and documented once,
in ``keel/config.py``; the rest of keel (its C code included) takes the values from there.

A scan of keel's Python and C sources finds every environment read; each file outside
``keel/config.py`` that reads the environment must be in ``ALLOWED``, with the reason, and
each file in ``ALLOWED`` must still read it (so the list stays true).
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from keel import config
from keel.config import Settings
from keel.errors import InvalidArgumentError
from keel.planning.policy import RuntimePolicy

REPO = Path(__file__).resolve().parents[1]

#: files other than keel/config.py that read the environment, and why that is right
ALLOWED: dict[str, str] = {
    "keel/hardware/sources.py": "the probe snapshots the environment as data about the machine "
                                "(fake machines supply their own)",
    "keel/hardware/__init__.py": "the probe records KEEL_BACKEND from that snapshot as a fact of "
                                 "the profile (HardwareProfile.forced_backend)",
    "keel/bench.py": "runs onnxruntime in a subprocess: the inherited environment plus "
                     "OMP_NUM_THREADS=1",
}

#: an environment read: os.environ, os.getenv, C's getenv(), environ.get, or a KEEL_*
#: variable looked up in some mapping
READ = re.compile(r"os\.environ|os\.getenv|\bgetenv\s*\(|\benviron\.get\b"
                  r"|\.get\(\s*[\"']KEEL_|\[\s*[\"']KEEL_\w*[\"']\s*\]")


def _sources() -> list[Path]:
    keel = REPO / "keel"
    native = keel / "native" / "src"
    return sorted([*keel.rglob("*.py"), *native.glob("*.c"), *native.glob("*.h")])


def _readers() -> dict[str, list[str]]:
    """Every file that reads the environment -> its reading lines."""
    found: dict[str, list[str]] = {}
    for path in _sources():
        lines = [f"{n}: {line.strip()}"
                 for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1)
                 if READ.search(line)]
        if lines:
            found[path.relative_to(REPO).as_posix()] = lines
    return found


def test_the_scan_covers_python_and_c() -> None:
    names = {p.relative_to(REPO).as_posix() for p in _sources()}
    assert {"keel/config.py", "keel/native/src/threads.c", "keel/native/build.py"} <= names


@pytest.mark.parametrize("line", [
    'raw = os.environ["KEEL_THREADS"]', 'os.getenv("HOME")', 'const char *s = getenv("X");',
    'environ.get("KEEL_CC")', 'env.get( "KEEL_NATIVE", "")', 'env["KEEL_SPIN_US"]',
])
def test_the_scan_sees_each_way_of_reading(line: str) -> None:
    assert READ.search(line)


@pytest.mark.parametrize("line", [
    "threads = settings().threads", 'f"KEEL_THREADS={raw!r} must be a positive integer"',
    "static int64_t spin_ns(void) { return pool.spin_ns; }",
])
def test_the_scan_leaves_other_code_alone(line: str) -> None:
    assert not READ.search(line)


def test_only_config_and_the_listed_files_read_the_environment() -> None:
    readers = _readers()
    assert "keel/config.py" in readers
    unlisted = {path: lines for path, lines in readers.items()
                if path != "keel/config.py" and path not in ALLOWED}
    assert not unlisted, ("read the setting in keel/config.py (Settings) and pass it down, "
                          f"or list the file in ALLOWED with why: {unlisted}")


def test_every_listed_file_still_reads_the_environment() -> None:
    stale = sorted(set(ALLOWED) - set(_readers()))
    assert not stale, f"these files no longer read the environment; drop them from ALLOWED: {stale}"


def _read_by_config() -> set[str]:
    return set(re.findall(r"\"(KEEL_[A-Z_]+)\"", (REPO / "keel" / "config.py").read_text()))


def test_the_readme_documents_every_setting() -> None:
    table = set(re.findall(r"^\| `(KEEL_[A-Z_]+)` \|", (REPO / "README.md").read_text(), re.M))
    assert table == _read_by_config()


def test_every_setting_is_read_into_settings() -> None:
    every = {
        "KEEL_BACKEND": "CPU", "KEEL_PRECISION": "fp16", "KEEL_MEMORY_LIMIT": "1GiB",
        "KEEL_THREADS": " 6 ", "KEEL_STRICT": "yes", "KEEL_NATIVE": "0", "KEEL_CC": "clang",
        "KEEL_SPIN_US": "0", "KEEL_CALIBRATION": "off", "KEEL_CACHE_DIR": "/tmp/keel-x",
        "KEEL_IDLE_SPIN_US": "25",
        "KEEL_PREFER_GPU": "false", "KEEL_MIN_GPU_MEMORY_GB": "12.5",
        "KEEL_PREFER_LIGHTWEIGHT_PYTHON_ON_LOW_MEMORY": "off",
        "KEEL_LIGHTWEIGHT_MEMORY_THRESHOLD_GB": "3", "KEEL_ALLOW_ACCELERATOR_EXPERIMENTS": "1",
        "KEEL_PLAN_CACHE": "off", "KEEL_HINT": "Throughput", "KEEL_BUILD_TIMEOUT": "30",
        "KEEL_CFLAGS": "-fsanitize=address -DX='a b'", "KEEL_BATCH_INVARIANT": "off",
        "KEEL_CUDA_GRAPHS": "off", "KEEL_PLACEMENT_TRIALS": "off", "KEEL_GPU_KERNELS": "off",
        "KEEL_NUMA_PIN": "off", "KEEL_INTEROP": "no", "KEEL_CODE_CACHE": "off",
        "KEEL_THREAD_COSTS": "On",
    }
    assert set(every) == _read_by_config()
    assert Settings.from_env(every) == Settings(
        backend="cpu", precision="fp16", memory_limit=1024**3, threads=6, strict=True,
        native="off", cc="clang", spin_us=0, calibration="off", cache_dir=Path("/tmp/keel-x"),
        idle_spin_us=25,
        prefer_gpu=False, min_gpu_memory_gb=12.5, prefer_lightweight_python_on_low_memory=False,
        lightweight_memory_threshold_gb=3.0, allow_accelerator_experiments=True,
        plan_cache=False, hint="throughput", build_timeout_s=30.0,
        cflags=("-fsanitize=address", "-DX=a b"), batch_invariant=False,
        cuda_graphs=False, placement_trials=False, gpu_kernels=False, numa_pin=False,
        interop=False, code_cache=False, thread_costs="on")


def test_unset_settings_take_their_defaults() -> None:
    values = Settings.from_env({"HOME": "/home/k"})
    assert (values.backend, values.threads, values.native, values.cc, values.spin_us,
            values.calibration, values.prefer_gpu) == (None, None, "auto", None, 200, None, None)
    assert values.policy_overrides() == {}
    assert values.cache_dir == config.cache_dir({"HOME": "/home/k"})


@pytest.mark.parametrize(("var", "raw", "message"), [
    ("KEEL_BACKEND", "tpu", "KEEL_BACKEND='tpu' is not allowed; use one of auto, gpu, cpu"),
    ("KEEL_PRECISION", "tf32", "KEEL_PRECISION='tf32' is not allowed; use one of auto, fp32"),
    ("KEEL_MEMORY_LIMIT", "lots", "KEEL_MEMORY_LIMIT 'lots' is not a size"),
    ("KEEL_THREADS", "0", "KEEL_THREADS='0' must be a positive integer"),
    ("KEEL_THREADS", "two", "KEEL_THREADS='two' must be a positive integer"),
    ("KEEL_STRICT", "maybe", "KEEL_STRICT='maybe' must be one of 1/0, true/false"),
    ("KEEL_NATIVE", "sometimes", "KEEL_NATIVE='sometimes' is not allowed; use one of auto, on"),
    ("KEEL_SPIN_US", "-1", "KEEL_SPIN_US='-1' must be a whole number >= 0"),
    ("KEEL_PREFER_GPU", "perhaps", "KEEL_PREFER_GPU='perhaps' must be one of 1/0"),
    ("KEEL_MIN_GPU_MEMORY_GB", "lots", "KEEL_MIN_GPU_MEMORY_GB='lots' must be a number of GiB"),
    ("KEEL_LIGHTWEIGHT_MEMORY_THRESHOLD_GB", "-2",
     "KEEL_LIGHTWEIGHT_MEMORY_THRESHOLD_GB='-2' must be a finite number of GiB >= 0"),
])
def test_a_bad_value_names_the_variable_and_what_it_takes(var: str, raw: str,
                                                          message: str) -> None:
    with pytest.raises(InvalidArgumentError, match=re.escape(message)):
        Settings.from_env({var: raw})


def test_settings_are_read_once_until_reloaded(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KEEL_THREADS", "7")
    monkeypatch.setenv("KEEL_MIN_GPU_MEMORY_GB", "2")
    before = config.settings()
    assert config.settings() is before and before.threads != 7
    after = config.reload_settings()
    assert config.settings() is after and after.threads == 7
    assert RuntimePolicy.from_env().min_gpu_memory_gb == 2.0       # the policy reads them too
