"""``keel convert MODEL -o OUT.keel|OUT.onnx``: import, optimize, save.

Reads an ONNX model (or a ``.keel`` file), runs the optimization passes of
the chosen level and writes either keel's own ``.keel`` file (memory-mappable
weights, optional zlib compression and float16 storage) or an ONNX model.
Prints sizes before and after and the passes that changed the graph.
"""

from __future__ import annotations

import json
import os
import time
from collections import Counter
from pathlib import Path
from typing import Any

import typer
from rich.console import Console
from rich.table import Table

from keel.config import format_bytes
from keel.errors import InvalidArgumentError
from keel.graph.ir import Graph

__all__ = ["convert", "convert_model", "register"]


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
    as_json: bool = typer.Option(False, "--json", help="Print JSON."),
) -> None:
    """Optimize MODEL and save it as a .keel file or an ONNX model."""
    report = convert_model(model, output, optimization_level, compress=compress, fp16=fp16,
                           custom_domain=custom_domain)
    if as_json:
        typer.echo(json.dumps(report, indent=2))
    else:
        _print(report)


def convert_model(model: str | os.PathLike[str], output: str | os.PathLike[str],
                  level: str = "all", *, compress: bool = False, fp16: bool = False,
                  custom_domain: bool = False) -> dict[str, Any]:
    """Do the conversion; returns the report ``keel convert --json`` prints."""
    from keel.graph.passes import optimize_with_report

    out = Path(output)
    kind = out.suffix.lower()
    if kind not in (".keel", ".onnx"):
        raise InvalidArgumentError(f"output {str(out)!r} must end in .keel or .onnx")
    start = time.perf_counter()
    graph = _load(model)
    result = optimize_with_report(graph, level)
    if kind == ".keel":
        from keel.formats.keel_format import save_keel

        save_keel(result.graph, out, compress=compress, fp16=fp16)
    else:
        _save_onnx(result.graph, out, custom_domain)
    return {
        "input": {"path": str(model), **_summary(graph, Path(model).stat().st_size)},
        "output": {"path": str(out), "format": kind[1:],
                   **_summary(result.graph, out.stat().st_size)},
        "optimization_level": level,
        "passes_applied": result.applied,
        "options": {"compress": compress, "fp16": fp16, "keel_ops": custom_domain},
        "seconds": round(time.perf_counter() - start, 4),
    }


def _load(model: str | os.PathLike[str]) -> Graph:
    from keel.formats.keel_format import is_keel_file, load_keel
    from keel.graph.importers.onnx import import_onnx

    if is_keel_file(model):
        return load_keel(model)
    return import_onnx(model)


def _save_onnx(graph: Graph, out: Path, custom_domain: bool) -> None:
    import onnx

    from keel.graph.export import to_onnx

    proto = to_onnx(graph, custom_domain=custom_domain)
    weights = sum(int(a.nbytes) for a in graph.initializers.values())
    out.parent.mkdir(parents=True, exist_ok=True)
    if weights > (1 << 31) - (64 << 20):  # protobuf's 2 GiB limit, with room for the graph
        onnx.save_model(proto, str(out), save_as_external_data=True,
                        location=f"{out.name}.data")
    else:
        onnx.save_model(proto, str(out))


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
