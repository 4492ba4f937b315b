"""``keel convert MODEL -o OUT.keel|OUT.onnx``: import, optimize, quantize, save.

Reads an ONNX model (or a ``.keel`` file), runs the optimization passes of
the chosen level, optionally quantizes it to int8/int16 (``--quantize``,
weight-only or static QDQ with ``--calibration`` samples; see
:mod:`keel.graph.quantize`) and writes either keel's own ``.keel`` file
(memory-mappable weights, optional zlib compression and float16 storage) or an
ONNX model. Both are written atomically (a temporary file renamed into place):
a failed conversion leaves no output behind and an existing file untouched.
Prints sizes before and after, the passes that changed the graph and what
quantization did.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import tempfile
import time
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import typer
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn
from rich.table import Table

from keel.config import format_bytes
from keel.errors import InvalidArgumentError
from keel.graph.ir import Graph, Value
from keel.graph.quantize import QuantizeOptions
from keel.ops.registry import Op

__all__ = ["calibration_progress", "convert", "convert_model", "register"]


def register(app: typer.Typer) -> None:
    app.command("convert")(convert)


def convert(
    model: str = typer.Argument(..., help="Model file (.onnx or .keel)."),
    output: Path = typer.Option(..., "--output", "-o", help="OUT.keel or OUT.onnx."),
    optimization_level: str = typer.Option("all", "--optimization-level", "-O",
                                           help="none, basic, extended or all."),
    compress: bool = typer.Option(False, "--compress",
                                  help=".keel: zlib-compress weights where it helps."),
    fp16: bool = typer.Option(False, "--fp16", help=".keel: store float weights as float16 "
                              "(lossy; they load in their original dtype)."),
    custom_domain: bool = typer.Option(False, "--keel-ops", help=".onnx: keep fused ops as "
                                       "ai.keel nodes (keel re-imports them; onnxruntime "
                                       "cannot run them)."),
    quantize: str | None = typer.Option(None, "--quantize", help="int8 or int16: store "
                                        "Conv/Gemm/MatMul weights as integers."),
    quantize_mode: str | None = typer.Option(None, "--quantize-mode", help="weight-only "
                                             "(default) or qdq (also activations; needs "
                                             "--calibration)."),
    calibration: Path | None = typer.Option(None, "--calibration", help="qdq: an .npz of "
                                            "input samples keyed by input name."),
    calibration_method: str | None = typer.Option(None, "--calibration-method",
                                                  help="qdq: minmax (default) or percentile."),
    percentile: float | None = typer.Option(None, "--percentile", help="qdq with percentile: "
                                            "the percentile kept (default 99.99)."),
    activation_dtype: str | None = typer.Option(None, "--activation-dtype", help="qdq: uint8 "
                                                "(default) or int8; uint16 or int16 with "
                                                "int16."),
    calibration_batch: int | None = typer.Option(None, "--calibration-batch-size",
                                                 help="qdq: samples run at once (default 32)."),
    as_json: bool = typer.Option(False, "--json", help="Print JSON."),
) -> None:
    """Optimize MODEL (optionally quantize it) and save it as a .keel file or an ONNX model."""
    extras = {"--quantize-mode": quantize_mode, "--calibration": calibration,
              "--calibration-method": calibration_method, "--percentile": percentile,
              "--activation-dtype": activation_dtype,
              "--calibration-batch-size": calibration_batch}
    options = _quantize_options(quantize, extras)
    with calibration_progress() as progress:
        report = convert_model(model, output, optimization_level, compress=compress,
                               fp16=fp16, custom_domain=custom_domain, quantize=options,
                               calibration=calibration, progress=progress)
    if as_json:
        typer.echo(json.dumps(report, indent=2))
    else:
        _print(report)


def _quantize_options(bits: str | None, extras: dict[str, Any]) -> QuantizeOptions | None:
    given = [flag for flag, value in extras.items() if value is not None]
    if bits is None:
        if given:
            raise InvalidArgumentError(f"{', '.join(given)}: only used with --quantize "
                                       "int8|int16")
        return None
    fields = {"mode": "--quantize-mode", "method": "--calibration-method",
              "percentile": "--percentile", "activation_dtype": "--activation-dtype",
              "batch_size": "--calibration-batch-size"}
    chosen = {f: extras[flag] for f, flag in fields.items() if extras[flag] is not None}
    options = QuantizeOptions(bits, **chosen)
    qdq_only = [flag for flag in given if flag != "--quantize-mode"]
    if options.mode != "qdq" and qdq_only:
        raise InvalidArgumentError(f"{', '.join(qdq_only)}: only used with --quantize-mode qdq "
                                   f"(not {options.mode})")
    if extras["--percentile"] is not None and options.method != "percentile":
        raise InvalidArgumentError("--percentile: only used with --calibration-method "
                                   "percentile")
    return options


@contextlib.contextmanager
def calibration_progress(console: Console | None = None) -> Iterator[Callable[[int, int], None]]:
    """A progress bar (on stderr, on a terminal) fed with calibration's (done, total) calls.

    It appears once a calibration needs more than one batch, and is cleared when done.
    """
    console = console or Console(stderr=True)
    bar = Progress(TextColumn("calibrating"), BarColumn(), MofNCompleteColumn(),
                   TextColumn("samples"), TimeRemainingColumn(), console=console,
                   transient=True, disable=not console.is_terminal)
    task: list[Any] = []

    def update(done: int, total: int) -> None:
        if not task:
            if done >= total:
                return              # one batch did it all: nothing to watch
            task.append(bar.add_task("calibrating", total=total))
            bar.start()
        bar.update(task[0], completed=done)

    try:
        yield update
    finally:
        bar.stop()


def convert_model(model: str | os.PathLike[str], output: str | os.PathLike[str],
                  level: str = "all", *, compress: bool = False, fp16: bool = False,
                  custom_domain: bool = False, quantize: QuantizeOptions | None = None,
                  calibration: str | os.PathLike[str] | None = None,
                  progress: Callable[[int, int], None] | None = None) -> dict[str, Any]:
    """Do the conversion; returns the report ``keel convert --json`` prints.

    ``quantize`` quantizes the optimized graph (``calibration``: the ``.npz``
    qdq mode needs; ``progress`` is called after each calibration batch).
    Nothing is written unless every step succeeds.
    """
    from keel.graph.passes import optimize_with_report

    out = Path(output)
    kind = out.suffix.lower()
    if kind not in (".keel", ".onnx"):
        raise InvalidArgumentError(f"output {str(out)!r} must end in .keel or .onnx")
    if quantize is not None and fp16:
        raise InvalidArgumentError("--fp16 cannot be combined with --quantize: quantization "
                                   "scales must keep their float32 precision")
    start = time.perf_counter()
    graph = _load(model)
    pinned, integer_weights = _pin_integer_weights(graph)
    result = optimize_with_report(pinned, level)
    optimized = _unpin(result.graph, integer_weights)
    quantized = None
    if quantize is not None:
        from keel.graph.quantize import quantize_with_report

        quantized = quantize_with_report(optimized, quantize, calibration, progress)
        optimized = quantized.graph
    if kind == ".keel":
        from keel.formats.keel_format import save_keel

        save_keel(optimized, out, compress=compress, fp16=fp16)
    else:
        _save_onnx(optimized, out, custom_domain)
    return {
        "input": {"path": str(model), **_summary(graph, Path(model).stat().st_size)},
        "output": {"path": str(out), "format": kind[1:],
                   **_summary(optimized, out.stat().st_size)},
        "optimization_level": level,
        "passes_applied": result.applied,
        "options": {"compress": compress, "fp16": fp16, "keel_ops": custom_domain},
        "quantization": None if quantized is None else {
            **quantized.to_dict(),
            "calibration_file": None if calibration is None else str(calibration)},
        "seconds": round(time.perf_counter() - start, 4),
    }


def _pin_integer_weights(graph: Graph) -> tuple[Graph, set[str]]:
    """Keep an already quantized model quantized through optimization.

    Constant folding would turn DEQUANTIZE_LINEAR of a constant into a float
    weight (right when loading to run, wrong when saving: the file would grow
    back). Declared as graph inputs with defaults, the integer weights are not
    constants, so folding leaves them; :func:`_unpin` undeclares them after.
    """
    names = {n.inputs[0] for n in graph.nodes
             if n.op is Op.DEQUANTIZE_LINEAR and graph.is_constant(n.inputs[0])}
    if not names:
        return graph, names
    g = graph.copy()
    for name in sorted(names):
        t = g.type_of(name)
        if t is not None:
            g.inputs.append(Value(name, t))
    return g, names


def _unpin(graph: Graph, names: set[str]) -> Graph:
    if names:
        graph.inputs = [v for v in graph.inputs if v.name not in names]
    return graph


def _load(model: str | os.PathLike[str]) -> Graph:
    from keel.formats.keel_format import is_keel_file, load_keel
    from keel.graph.importers.onnx import import_onnx

    if is_keel_file(model):
        return load_keel(model)
    return import_onnx(model)


def _save_onnx(graph: Graph, out: Path, custom_domain: bool) -> None:
    """Write the ONNX model into a temporary folder beside ``out``, then rename it in."""
    import onnx

    from keel.graph.export import to_onnx

    proto = to_onnx(graph, custom_domain=custom_domain)
    weights = sum(int(a.nbytes) for a in graph.initializers.values())
    external = weights > (1 << 31) - (64 << 20)  # protobuf's 2 GiB limit, with room
    out.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        if external:
            onnx.save_model(proto, str(staging / out.name), save_as_external_data=True,
                            location=f"{out.name}.data")
            # The data first: the model file appears only once what it points at is there.
            os.replace(staging / f"{out.name}.data", out.parent / f"{out.name}.data")
        else:
            onnx.save_model(proto, str(staging / out.name))
        os.replace(staging / out.name, out)
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def _summary(graph: Graph, file_bytes: int) -> dict[str, Any]:
    return {
        "file_bytes": file_bytes,
        "nodes": len(graph.nodes),
        "initializers": len(graph.initializers),
        "weight_bytes": sum(int(a.nbytes) for a in graph.initializers.values()),
        "ops": dict(sorted(Counter(n.op.value for n in graph.nodes).items())),
    }


def _print(report: dict[str, Any]) -> None:
    console = Console()
    table = Table(title="keel convert")
    table.add_column("")
    table.add_column("input")
    table.add_column("output")
    before, after = report["input"], report["output"]
    table.add_row("file", before["path"], after["path"])
    table.add_row("size", format_bytes(before["file_bytes"]), format_bytes(after["file_bytes"]))
    table.add_row("nodes", str(before["nodes"]), str(after["nodes"]))
    table.add_row("weights", format_bytes(before["weight_bytes"]),
                  format_bytes(after["weight_bytes"]))
    console.print(table)
    applied = ", ".join(report["passes_applied"]) or "none changed the graph"
    console.print(f"optimization level {report['optimization_level']}: {applied}")
    q = report.get("quantization")
    if q:
        how = q["mode"] if q["calibration"] is None else (
            f"{q['mode']}, activations {q['activation_dtype']} from "
            f"{q['calibration']['samples']} samples ({q['calibration']['method']})")
        console.print(f"quantized {q['quantized_nodes']} nodes to {q['weight_dtype']} ({how}); "
                      f"weights {format_bytes(q['weight_bytes_before'])} → "
                      f"{format_bytes(q['weight_bytes_after'])}")
        for item in q["skipped"]:
            console.print(f"  left float: {item['node']} ({item['reason']})")
