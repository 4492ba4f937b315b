"""Side-by-side timing of keel and onnxruntime on one model, in one process.

Shared machines flip between fast and slow states from one moment to the
next, so nothing here trusts a single time: runs alternate between the
runtimes pass by pass, each pass gives a ratio of medians, and the reported
ratio is the median over passes. Speed is reported, never asserted.

Two methods (``BenchConfig.method``):

* ``"blocks"``: in each pass a block of keel's runs, then one of the other
  runtime's, back to back.
* ``"settled"``: the same alternating blocks, but before each block the
  process's other threads must have gone idle (:func:`settle`: the runtime
  timed last parks its worker pool — onnxruntime's workers spin for tens of
  milliseconds after its last run, keel's for ``KEEL_IDLE_SPIN_US``), each
  block starts with an untimed run (waking the runtime's own workers), and
  the order of the runtimes swaps from pass to pass. With several threads this
  times each runtime without the other's spinning workers on its cores.
"""

from __future__ import annotations

import functools
import gc
import json
import os
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

from keel.errors import BackendSelectionError, InvalidArgumentError

__all__ = [
    "METHODS",
    "BenchConfig",
    "Measurement",
    "ModelReport",
    "bench_model",
    "check_dims",
    "concrete_shape",
    "peak_rss_delta",
    "random_feeds",
    "settle",
]

Runner = Callable[[], Any]


@dataclass(frozen=True)
class BenchConfig:
    batches: tuple[int, ...] = (1, 32)
    threads: tuple[int, ...] = (1,)
    passes: int = 5
    min_pass_seconds: float = 0.2      # per runtime, per pass
    min_iters: int = 3
    backend: str = "cpu"
    vs: str | None = "onnxruntime"
    dims: tuple[tuple[str, int], ...] = ()   # sizes of named symbolic dimensions (--dim)
    method: str = "blocks"             # "blocks" or "settled" (the module docstring)


@dataclass(frozen=True)
class Measurement:
    runtime: str                       # "keel:cpu" or "onnxruntime"
    batch: int
    threads: int
    median_ms: float
    p90_ms: float
    throughput: float                  # samples per second, from the median
    samples: int


@dataclass
class ModelReport:
    model: str
    measurements: list[Measurement] = field(default_factory=list)
    # (batch, threads) -> median over passes of keel_median / other_median
    ratios: dict[str, float] = field(default_factory=dict)
    load_ms: dict[str, float] = field(default_factory=dict)
    peak_rss_mb: dict[str, float] = field(default_factory=dict)
    # a whole fresh process loading the .keel file: first_predict_ms, cpu_ms, vmhwm_mb
    process: dict[str, float] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2)


def concrete_shape(shape: Sequence[Any] | None, batch: int,
                   dims: Mapping[str, int] | None = None) -> tuple[int, ...]:
    """``shape`` with its symbolic dimensions sized: a name in ``dims`` takes its value,
    any other unknown takes ``batch`` when first, else 1."""
    sizes = dims or {}
    return tuple(d if isinstance(d, int)
                 else sizes[d] if isinstance(d, str) and d in sizes
                 else (batch if i == 0 else 1)
                 for i, d in enumerate(shape or ()))


def check_dims(inputs: Sequence[Any], dims: Mapping[str, int]) -> None:
    """Refuse a ``--dim`` name that no input's shape carries, naming the ones it does."""
    known = list(dict.fromkeys(d for info in inputs for d in (info.shape or ())
                               if isinstance(d, str)))
    unknown = [name for name in dims if name not in known]
    if unknown:
        raise InvalidArgumentError(
            f"--dim {unknown[0]!r} is not a symbolic dimension of this model; its symbolic "
            f"dimensions are: {', '.join(known) or 'none'}")


def random_feeds(inputs: Sequence[Any], batch: int, seed: int = 0,
                 dims: Mapping[str, int] | None = None) -> dict[str, np.ndarray]:
    """Random feeds for keel ``TensorInfo`` inputs; symbolic dims take their ``dims``
    value, else ``batch`` (first) or 1."""
    rng = np.random.default_rng(seed)
    feeds: dict[str, np.ndarray] = {}
    for info in inputs:
        shape = concrete_shape(info.shape, batch, dims)
        dtype = np.dtype(info.dtype.numpy if hasattr(info.dtype, "numpy") else info.dtype)
        if dtype.kind in "iu":
            feeds[info.name] = rng.integers(0, 100, size=shape).astype(dtype)
        elif dtype.kind == "b":
            feeds[info.name] = rng.random(shape) > 0.5
        else:
            feeds[info.name] = rng.standard_normal(shape).astype(dtype)
    return feeds


METHODS = ("blocks", "settled")
SETTLE_WINDOW_S = 0.01        # settle(): the window the other threads must be idle in
SETTLE_QUIET_SHARE = 0.1      # ... using less than this share of one core
SETTLE_LIMIT_S = 0.5          # ... waiting at most this long


def _others_cpu_ns() -> int | None:
    """CPU time the process's threads other than this one have used (Linux's
    ``/proc/self/task/*/schedstat``); None where the platform does not say."""
    me = threading.get_native_id()
    try:
        tids = os.listdir("/proc/self/task")
    except OSError:
        return None
    total = 0
    for tid in tids:
        if tid == str(me):
            continue
        try:
            with open(f"/proc/self/task/{tid}/schedstat") as f:
                total += int(f.read().split()[0])
        except (OSError, ValueError, IndexError):     # the thread ended meanwhile
            continue
    return total


def settle(window_s: float = SETTLE_WINDOW_S, quiet_share: float = SETTLE_QUIET_SHARE,
           limit_s: float = SETTLE_LIMIT_S) -> float:
    """Wait until the process's other threads (the runtimes' worker pools, BLAS's) are
    idle: a window of ``window_s`` in which together they used less than
    ``quiet_share`` of one core, or ``limit_s`` in all. Returns the seconds waited.
    Where the platform does not report per-thread CPU time: three windows, flat."""
    start = time.perf_counter()
    before = _others_cpu_ns()
    if before is None:
        time.sleep(3 * window_s)
        return time.perf_counter() - start
    while True:
        time.sleep(window_s)
        after = _others_cpu_ns()
        waited = time.perf_counter() - start
        if after is None or after - before < quiet_share * window_s * 1e9 or waited >= limit_s:
            return waited
        before = after


def _time_block(run: Runner, min_seconds: float, min_iters: int) -> list[float]:
    times: list[float] = []
    start = time.perf_counter()
    while len(times) < min_iters or time.perf_counter() - start < min_seconds:
        t0 = time.perf_counter()
        run()
        times.append((time.perf_counter() - t0) * 1e3)
    return times


# onnxruntime's execution provider for the device each keel backend runs on.
ORT_PROVIDERS = {"cpu": "CPUExecutionProvider", "reference": "CPUExecutionProvider",
                 "gpu": "CUDAExecutionProvider"}


def _ort_session(model: bytes, threads: int, backend: str = "cpu") -> Any:
    try:
        import onnxruntime as ort
    except ImportError:
        raise BackendSelectionError(
            "onnxruntime", "the onnxruntime package is not installed (pip install onnxruntime)"
        ) from None
    provider = ORT_PROVIDERS.get(backend, "CPUExecutionProvider")
    if provider not in ort.get_available_providers():
        raise BackendSelectionError(
            "onnxruntime", f"its {provider} is not available here (onnxruntime "
            f"{ort.__version__} offers {', '.join(ort.get_available_providers())}); "
            "for the gpu comparison install onnxruntime-gpu")
    opts = ort.SessionOptions()
    opts.intra_op_num_threads = threads
    opts.inter_op_num_threads = 1
    opts.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
    return ort.InferenceSession(model, opts, providers=[provider])


class _TorchRunner:
    """torch on the same graph (:class:`keel.torch_graph.TorchGraph`), with
    onnxruntime's ``run(None, feeds)`` shape: NumPy in and out, on the device keel's
    backend uses (CUDA for gpu, TF32 off), at ``threads`` intra-op threads."""

    def __init__(self, model: bytes, threads: int, backend: str) -> None:
        try:
            import torch
        except ImportError:
            raise BackendSelectionError(
                "torch", "torch is not installed (pip install 'keel-runtime[zoo]')") from None
        from keel.torch_graph import TorchGraph

        device = "cuda" if backend == "gpu" else "cpu"
        if device == "cuda" and not torch.cuda.is_available():
            raise BackendSelectionError("torch", "torch sees no CUDA device")
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
        torch.set_num_threads(threads)
        self.torch, self.device = torch, device
        self.name = f"torch:{device}"
        self.graph = TorchGraph(model, device=device)

    def run(self, names: Any, feeds: Mapping[str, np.ndarray]) -> list[np.ndarray]:
        torch = self.torch
        with torch.no_grad():
            out = self.graph({k: torch.from_numpy(np.ascontiguousarray(v)).to(self.device)
                              for k, v in feeds.items()})
        return [v.cpu().numpy() for v in out.values()]


def _torch_runner(model: bytes, threads: int, backend: str) -> _TorchRunner:
    return _TorchRunner(model, threads, backend)


def _load_keel(model: bytes, backend: str, threads: int) -> Any:
    from keel.execution.model import load_model

    return load_model(model, backend=backend, threads=threads)


def bench_model(
    name: str,
    model: bytes,
    config: BenchConfig,
    feeds_for: Callable[[int], Mapping[str, np.ndarray]] | None = None,
    progress: Callable[[str], None] | None = None,
) -> ModelReport:
    """Measure keel (and ``config.vs``) on ``model`` for every batch × threads."""
    if config.vs not in (None, "onnxruntime", "torch"):
        raise InvalidArgumentError(
            f"--vs {config.vs!r} is not supported; allowed: onnxruntime, torch")
    if config.method not in METHODS:
        raise InvalidArgumentError(
            f"method {config.method!r} is not supported; allowed: {', '.join(METHODS)}")
    report = ModelReport(name)
    for threads in config.threads:
        keel_model, keel_load = _timed_load(
            functools.partial(_load_keel, model, config.backend, threads))
        report.load_ms.setdefault(f"keel:{config.backend}", keel_load)
        ort_sess = None
        if config.vs == "torch":
            ort_sess, ort_load = _timed_load(
                functools.partial(_torch_runner, model, threads, config.backend))
            report.load_ms.setdefault(ort_sess.name, ort_load)
        elif config.vs:
            ort_sess, ort_load = _timed_load(
                functools.partial(_ort_session, model, threads, config.backend))
            report.load_ms.setdefault("onnxruntime", ort_load)
        check_dims(keel_model.inputs, dict(config.dims))
        for batch in config.batches:
            feeds = dict(feeds_for(batch) if feeds_for
                         else random_feeds(keel_model.inputs, batch, dims=dict(config.dims)))
            if config.dims:
                shapes = ", ".join(f"{k}={tuple(v.shape)}" for k, v in feeds.items())
                report.notes.append(f"batch {batch}, {threads} thread(s): inputs {shapes}")
            if progress:
                progress(f"{name}: batch {batch}, {threads} thread(s)")
            _bench_pair(report, keel_model, ort_sess, feeds, batch, threads, config)
    return report


def _timed_load(load: Callable[[], Any], repeats: int = 3) -> tuple[Any, float]:
    times, obj = [], None
    for _ in range(repeats):
        gc.collect()
        t0 = time.perf_counter()
        obj = load()
        times.append((time.perf_counter() - t0) * 1e3)
    return obj, statistics.median(times)


def _bench_pair(report: ModelReport, keel_model: Any, ort_sess: Any,
                feeds: dict[str, np.ndarray], batch: int, threads: int,
                config: BenchConfig) -> None:
    runners: dict[str, Runner] = {f"keel:{config.backend}": lambda: keel_model.predict(feeds)}
    other = getattr(ort_sess, "name", "onnxruntime")
    if ort_sess is not None:
        runners[other] = lambda: ort_sess.run(None, feeds)
    for run in runners.values():       # warm up: first-run planning, caches, thread pools
        run()
        run()
    samples: dict[str, list[float]] = {k: [] for k in runners}
    waits: dict[str, list[float]] = {k: [] for k in runners}
    pass_ratios: list[float] = []
    settled = config.method == "settled"
    for index in range(config.passes):
        medians = {}
        order = list(runners.items())
        if settled and index % 2:
            order.reverse()                 # neither runtime always follows the other
        for key, run in order:
            if settled:
                waits[key].append(settle())
                run()                       # untimed: wakes this runtime's own workers
            block = _time_block(run, config.min_pass_seconds, config.min_iters)
            samples[key].extend(block)
            medians[key] = statistics.median(block)
        if len(medians) == 2:
            keel_key = f"keel:{config.backend}"
            pass_ratios.append(medians[keel_key] / medians[other])
    for key, times in samples.items():
        med = statistics.median(times)
        report.measurements.append(Measurement(
            key, batch, threads, med, float(np.percentile(times, 90)),
            batch * 1e3 / med, len(times),
        ))
    if pass_ratios:
        report.ratios[f"b{batch}_t{threads}"] = statistics.median(pass_ratios)
    if settled:
        report.notes.append(
            f"batch {batch}, {threads} thread(s), settled blocks: the other threads went idle "
            + ", ".join(f"{1e3 * statistics.median(w):.0f} ms (median) before {k}'s blocks"
                        for k, w in waits.items() if w))


# The child reads its peak from /proc/self/status (VmHWM): ``ru_maxrss`` would
# start at the parent's size, since Linux carries it across fork and exec.
_RSS_SCRIPT = """
import resource, sys
import numpy as np

def peak_bytes():
    try:
        with open("/proc/self/status") as fh:
            for line in fh:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    scale = 1 if sys.platform == "darwin" else 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * scale

base = peak_bytes()
runtime, path, batch = sys.argv[1], sys.argv[2], int(sys.argv[3])
if runtime == "baseline":
    peak = base
else:
    if runtime == "onnxruntime":
        import onnxruntime as ort
        opts = ort.SessionOptions(); opts.intra_op_num_threads = 1
        sess = ort.InferenceSession(path, opts, providers=["CPUExecutionProvider"])
        inputs = [(i.name, i.shape, i.type) for i in sess.get_inputs()]
        run = lambda f: sess.run(None, f)
    else:
        import keel
        m = keel.load_model(path, backend=runtime.split(":")[1], threads=1)
        inputs = [(i.name, list(i.shape), "tensor(" + ("int64" if i.dtype.value == "int64"
                   else "float") + ")") for i in m.inputs]
        run = m.predict
    rng = np.random.default_rng(0)
    feeds = {}
    for name, shape, typ in inputs:
        shp = [d if isinstance(d, int) else (batch if k == 0 else 1) for k, d in enumerate(shape)]
        feeds[name] = (rng.integers(0, 100, size=shp) if "int64" in typ
                       else rng.standard_normal(shp).astype(np.float32))
    for _ in range(3):
        run(feeds)
    peak = peak_bytes()
print(peak)
"""


def peak_rss_delta(model_path: str, runtime: str, batch: int = 1) -> float:
    """Peak RSS (MB) of a fresh process that runs the model, minus one that imports numpy."""
    def measure(kind: str) -> int:
        out = subprocess.run(
            [sys.executable, "-c", _RSS_SCRIPT, kind, model_path, str(batch)],
            capture_output=True, text=True, timeout=600,
            env={**os.environ, "OMP_NUM_THREADS": "1"},
        )
        if out.returncode != 0:
            raise RuntimeError(f"peak-RSS child for {kind} failed: {out.stderr.strip()[-400:]}")
        return int(out.stdout.strip().splitlines()[-1])

    return (measure(runtime) - measure("baseline")) / 1e6
