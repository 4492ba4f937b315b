"""``keel run MODEL|DROP``: run a model (or a drop's) once on given or random inputs; print or
save the outputs."""

from __future__ import annotations

import json
import math
import os
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import typer
from rich.console import Console
from rich.table import Table

from keel._files import safe_file_name
from keel.bench import check_dims, concrete_shape
from keel.cli.common import parse_dims
from keel.config import format_bytes
from keel.dtypes import NARROW_FLOATS, NARROW_INTS
from keel.errors import InvalidArgumentError, MemoryLimitError
from keel.execution.model import Model, TensorInfo, load_model

__all__ = ["complete_feeds", "load_inputs", "output_summary", "random_feeds", "register",
           "run"]


def register(app: typer.Typer) -> None:
    app.command("run")(run)


def run(
    model: str = typer.Argument(..., help="Model file (.onnx or .keel), or a drop directory "
                                          "(`keel drop`), checked against its manifest."),
    inputs: list[str] = typer.Option([], "--input", "-i", help="NAME=FILE.npy (repeatable)."),
    random: bool = typer.Option(False, "--random", help="Random data for inputs not given."),
    backend: str = typer.Option("auto", "--backend", "-b", help="auto, cpu, reference, gpu…"),
    precision: str = typer.Option("auto", "--precision", help="auto, fp32, fp16, fp64…"),
    batch: int = typer.Option(1, "--batch",
                              help="Size of a symbolic first dimension for --random."),
    dims: list[str] = typer.Option([], "--dim",
                                   help="NAME=VALUE: size of a symbolic dimension (repeatable)."),
    seed: int = typer.Option(0, "--seed", help="Seed for --random."),
    memory_limit: str | None = typer.Option(None, "--memory-limit", help="e.g. 512MB."),
    output_dir: Path | None = typer.Option(None, "--output-dir", "-o",
                                           help="Save each output as NAME.npy here."),
    as_json: bool = typer.Option(False, "--json", help="Print JSON."),
) -> None:
    """Run MODEL once and summarise its outputs (shape, dtype, range), latency and plan."""
    _check_counts(batch, seed)          # bad options fail before the model loads or compiles
    feeds = load_inputs(inputs)
    loaded = load_model(model, backend=backend, precision=precision, memory_limit=memory_limit)
    feeds = complete_feeds(loaded, feeds, random, batch, seed, parse_dims(dims))
    start = time.perf_counter()
    outputs = loaded.predict(feeds)
    seconds = time.perf_counter() - start
    saved = _save(outputs, output_dir) if output_dir is not None else {}
    report = _report(loaded, feeds, outputs, seconds, saved)
    if as_json:
        typer.echo(json.dumps(report, indent=2))
    else:
        _print(report)


def load_inputs(specs: Sequence[str]) -> dict[str, np.ndarray]:
    """Parse ``NAME=FILE.npy`` options into arrays."""
    feeds: dict[str, np.ndarray] = {}
    for spec in specs:
        name, sep, path = spec.partition("=")
        if not sep or not name or not path:
            raise InvalidArgumentError(f"--input {spec!r} must look like NAME=FILE.npy")
        if name in feeds:
            raise InvalidArgumentError(f"--input {name!r} is given twice; give each input once")
        try:
            feeds[name] = np.load(path, allow_pickle=False)
        except (OSError, ValueError) as exc:
            raise InvalidArgumentError(f"cannot read input {name!r} from {path!r}: {exc}") \
                from None
    return feeds


def _check_counts(batch: int, seed: int) -> None:
    if batch < 0:
        raise InvalidArgumentError(f"--batch must be 0 or more, got {batch}")
    if seed < 0:
        raise InvalidArgumentError(f"--seed must be 0 or more, got {seed}")


def random_feeds(infos: Sequence[TensorInfo], batch: int = 1, seed: int = 0,
                 vocab: int | None = None, dims: Mapping[str, int] | None = None,
                 limit: int | None = None) -> dict[str, np.ndarray]:
    """Seeded random inputs: a symbolic dimension named in ``dims`` takes its value, other
    symbolic first dimensions are ``batch``, other unknowns 1.

    Inputs that would not fit in ``limit`` bytes (default: the memory available on this
    machine) are a :class:`MemoryLimitError` before anything is allocated.
    """
    _check_counts(batch, seed)
    shapes = {info.name: concrete_shape(info.shape, batch, dims) for info in infos}
    _check_fits(infos, shapes, batch, limit)
    rng = np.random.default_rng(seed)
    feeds: dict[str, np.ndarray] = {}
    for info in infos:
        shape = shapes[info.name]
        if info.dtype.is_float or info.dtype in NARROW_FLOATS:
            feeds[info.name] = rng.standard_normal(shape).astype(info.dtype.numpy)
        elif info.dtype in NARROW_INTS:         # 0 or 1: inside every 4- and 2-bit range
            feeds[info.name] = rng.integers(0, 2, size=shape).astype(info.dtype.numpy)
        elif info.dtype.is_int:
            high = vocab if vocab else 10
            feeds[info.name] = rng.integers(0, high, size=shape).astype(info.dtype.numpy)
        else:
            feeds[info.name] = (rng.random(shape) < 0.5).astype(info.dtype.numpy)
    return feeds


_CHECK_ABOVE = 64 << 20     # inputs smaller than this are made without asking the machine


def _check_fits(infos: Sequence[TensorInfo], shapes: Mapping[str, tuple[int, ...]],
                batch: int, limit: int | None) -> None:
    need = sum(math.prod(shapes[i.name]) * i.dtype.itemsize for i in infos)
    if need <= _CHECK_ABOVE:
        return
    if limit is None:
        from keel.hardware.memory import probe_memory
        from keel.hardware.sources import ProbeSources

        limit = probe_memory(ProbeSources.real()).effective_available_bytes
        what = "the memory available"
    else:
        what = "the memory limit"
    if limit is not None and need > limit:
        raise MemoryLimitError(
            f"random inputs at --batch {batch} need {format_bytes(need)}, more than {what} "
            f"({format_bytes(limit)}); use a smaller --batch", need, limit)


def _vocab(model: Model) -> int | None:
    value = model.graph.metadata.get("keel.vocab_size")
    return int(value) if value and value.isdigit() else None


def complete_feeds(model: Model, feeds: dict[str, np.ndarray], random: bool, batch: int,
                   seed: int, dims: Mapping[str, int]) -> dict[str, np.ndarray]:
    """``feeds`` checked against the model's inputs, with random data for the missing ones
    when ``random``; an unknown input or ``--dim`` name is an error naming the known ones."""
    infos = model.inputs
    names = [i.name for i in infos]
    unknown = [name for name in feeds if name not in names]
    if unknown:
        raise InvalidArgumentError(
            f"--input {unknown[0]!r}: the model has no input {unknown[0]!r}; its inputs are: "
            f"{', '.join(names) or 'none'}")
    check_dims(infos, dims)
    missing = [i for i in infos if i.name not in feeds]
    if missing and not random:
        raise InvalidArgumentError(
            f"input {missing[0].name!r} has no data; pass --input "
            f"{missing[0].name}=FILE.npy or --random")
    return {**random_feeds(missing, batch, seed, _vocab(model), dims, model.memory_limit),
            **feeds}


def output_summary(value: np.ndarray) -> dict[str, Any]:
    """Shape, dtype and range of one output, as plain data."""
    data: dict[str, Any] = {"shape": list(value.shape), "dtype": str(value.dtype)}
    if value.size and value.dtype.kind in "biuf":
        data.update(min=float(value.min()), max=float(value.max()),
                    mean=float(value.astype(np.float64).mean()))
    return data


def _save(outputs: Mapping[str, np.ndarray], directory: Path) -> dict[str, str]:
    saved = {}
    try:
        directory.mkdir(parents=True, exist_ok=True)
        for name, value in outputs.items():
            path = directory / f"{safe_file_name(name, 'output')}.npy"
            np.save(path, value, allow_pickle=False)
            saved[name] = os.fspath(path)
    except OSError as exc:
        raise InvalidArgumentError(
            f"cannot save outputs to --output-dir {os.fspath(directory)!r}: {exc}") from None
    return saved


def _report(model: Model, feeds: Mapping[str, np.ndarray], outputs: Mapping[str, np.ndarray],
            seconds: float, saved: Mapping[str, str]) -> dict[str, Any]:
    plan = model.plan
    return {
        "model": model.name,
        "backend": model.backend,
        "backends_used": plan.backends,
        "inputs": {k: {"shape": list(v.shape), "dtype": str(v.dtype)} for k, v in feeds.items()},
        "outputs": {k: output_summary(v) for k, v in outputs.items()},
        "latency_ms": seconds * 1000,
        "peak_bytes": plan.peak_bytes,
        "chunk_size_hint": plan.chunk_size_hint,
        "saved": dict(saved),
    }


def _print(report: Mapping[str, Any]) -> None:
    console = Console()
    table = Table(title=f"{report['model']}: outputs")
    for col in ("output", "shape", "dtype", "min", "max", "mean"):
        table.add_column(col, no_wrap=True)
    for name, o in report["outputs"].items():
        table.add_row(name, str(tuple(o["shape"])), o["dtype"],
                      *(f"{o[k]:.6g}" if k in o else "-" for k in ("min", "max", "mean")))
    console.print(table)
    used = ", ".join(f"{n} on {b}" for b, n in report["backends_used"].items())
    console.print(f"latency {report['latency_ms']:.2f} ms (first run, planning included); "
                  f"nodes: {used}; peak memory {format_bytes(report['peak_bytes'])}",
                  markup=False, highlight=False)
    for name, path in report["saved"].items():
        console.print(f"saved {name} -> {path}", markup=False, highlight=False)
