"""``keel validate MODEL --against onnxruntime|reference``: how far keel's outputs are.

Runs the model on keel (``--backend``) and on the oracle with the same inputs
and reports, per output, the largest absolute and relative errors and the
relative L2 error. With ``--per-node`` it compares every intermediate value in
graph order and names the first node whose outputs diverge.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass
from typing import Any, TypeVar

import numpy as np
import typer
from rich.console import Console
from rich.table import Table

from keel.cli.common import EXIT_MISMATCH, parse_dims
from keel.cli.run import complete_feeds, load_inputs
from keel.errors import BackendSelectionError, ExecutionError, InvalidArgumentError, KeelError
from keel.execution.model import OPTIMIZATION_LEVELS, Model, load_model

__all__ = ["Comparison", "compare", "first_divergence", "onnx_bytes", "register", "validate"]

ORACLES = ("onnxruntime", "reference")
T = TypeVar("T")


def register(app: typer.Typer) -> None:
    app.command("validate")(validate)


@dataclass(frozen=True)
class Comparison:
    """Errors of one array against its oracle."""

    name: str
    shape: tuple[int, ...]
    max_abs_error: float
    max_rel_error: float
    rel_l2_error: float
    ok: bool


def compare(name: str, got: np.ndarray, want: np.ndarray, rtol: float, atol: float,
            ) -> Comparison:
    """Errors of ``got`` against ``want``; ``ok``: every element within atol + rtol·|want|."""
    if got.shape != want.shape:
        return Comparison(name, tuple(got.shape), float("inf"), float("inf"), float("inf"),
                          False)
    if got.size == 0 or got.dtype.kind not in "biuf":
        same = bool(np.array_equal(got, want))
        err = 0.0 if same else float("inf")
        return Comparison(name, tuple(got.shape), err, err, err, same)
    a, b = got.astype(np.float64), want.astype(np.float64)
    diff = np.abs(a - b)
    finite = np.isfinite(a) == np.isfinite(b)
    diff = np.where(np.isnan(a) & np.isnan(b), 0.0, diff)
    scale = np.abs(b)
    rel = np.where(scale > atol, diff / np.maximum(scale, 1e-300), 0.0)
    norm = float(np.linalg.norm(b))
    l2 = float(np.linalg.norm(a - b)) / norm if norm > 0 else float(np.linalg.norm(a - b))
    ok = bool(finite.all() and np.all(diff <= atol + rtol * scale))
    return Comparison(name, tuple(got.shape), float(np.nanmax(diff)), float(np.nanmax(rel)),
                      l2, ok)


def validate(
    model: str = typer.Argument(..., help="Model file (.onnx or .keel)."),
    against: str = typer.Option(..., "--against", help="onnxruntime or reference."),
    backend: str = typer.Option("auto", "--backend", "-b", help="keel backend to check."),
    per_node: bool = typer.Option(False, "--per-node", help="Find the first diverging node."),
    inputs: list[str] = typer.Option([], "--input", "-i", help="NAME=FILE.npy (repeatable)."),
    batch: int = typer.Option(1, "--batch", help="Size of a symbolic first dimension."),
    dims: list[str] = typer.Option([], "--dim",
                                   help="NAME=VALUE: size of a symbolic dimension (repeatable)."),
    seed: int = typer.Option(0, "--seed", help="Seed for random inputs."),
    rtol: float = typer.Option(1e-4, "--rtol"),
    atol: float = typer.Option(1e-5, "--atol"),
    level: str = typer.Option("all", "--optimization-level",
                              help=f"{', '.join(OPTIMIZATION_LEVELS)}."),
    as_json: bool = typer.Option(False, "--json", help="Print JSON."),
) -> None:
    """Compare keel's outputs with onnxruntime's or keel's reference backend.

    Exit status 0: all outputs within the tolerance; 1: one is not; 2: it could not run.
    """
    if against not in ORACLES:
        raise InvalidArgumentError(f"--against {against!r} is not allowed; use one of "
                                   f"{', '.join(ORACLES)}")
    for flag, value in (("--rtol", rtol), ("--atol", atol)):
        if not value >= 0:  # also rejects NaN
            raise InvalidArgumentError(f"{flag} must be a non-negative number, got {value}")
    keel_model = load_model(model, backend=backend, optimization_level=level)
    feeds = complete_feeds(keel_model, load_inputs(inputs), True, batch, seed,
                           parse_dims(dims))
    report = validation_report(model, keel_model, feeds, against, per_node, rtol, atol, level)
    if as_json:
        typer.echo(json.dumps(report, indent=2))
    else:
        _print(report)
    if not report["ok"]:
        raise typer.Exit(EXIT_MISMATCH)


def validation_report(path: str, keel_model: Model, feeds: Mapping[str, np.ndarray],
                      against: str, per_node: bool, rtol: float, atol: float,
                      level: str) -> dict[str, Any]:
    """Everything ``validate`` prints, as plain data."""
    got = keel_model.predict(feeds)
    oracle = _Oracle(path, against, level)
    want = oracle.outputs(feeds, [o.name for o in keel_model.outputs])
    results = [compare(n, got[n], want[n], rtol, atol) for n in got]
    report: dict[str, Any] = {
        "model": keel_model.name, "backend": keel_model.backend,
        "backends_used": keel_model.plan.backends, "against": against,
        "rtol": rtol, "atol": atol,
        "outputs": [_plain(c) for c in results],
        "ok": all(c.ok for c in results),
    }
    if per_node:
        report["first_divergence"] = first_divergence(keel_model, oracle, feeds, rtol, atol)
    return report


class _Oracle:
    """onnxruntime, or keel's reference backend on the same optimized graph."""

    def __init__(self, path: str, kind: str, level: str) -> None:
        self.path, self.kind = path, kind
        self.reference = load_model(path, backend="reference", optimization_level=level) \
            if kind == "reference" else None

    def outputs(self, feeds: Mapping[str, np.ndarray], names: list[str]) -> dict[str, Any]:
        if self.reference is not None:
            return self.reference.predict(feeds)
        session = _ort_session(onnx_bytes(self.path))
        values = _ort_call(lambda: session.run(names, dict(feeds)))
        return dict(zip(names, values, strict=True))

    def values(self, feeds: Mapping[str, np.ndarray]) -> tuple[dict[str, Any], list[Any]]:
        """Every intermediate value, and the nodes in order as (name, op, outputs)."""
        if self.reference is not None:
            nodes = [(n.name, n.op.value, list(n.outputs)) for n in self.reference.graph.nodes]
            return self.reference.intermediates(feeds), nodes
        return _ort_intermediates(onnx_bytes(self.path), feeds)


def first_divergence(model: Model, oracle: _Oracle, feeds: Mapping[str, np.ndarray],
                     rtol: float, atol: float) -> dict[str, Any]:
    """The first node, in graph order, with an output outside the tolerance (node None: none)."""
    mine = model.intermediates(feeds)
    theirs, nodes = oracle.values(feeds)
    compared = 0
    for name, op, outputs in nodes:
        for out in outputs:
            if not out or out not in mine or out not in theirs:
                continue
            compared += 1
            c = compare(out, np.asarray(mine[out]), np.asarray(theirs[out]), rtol, atol)
            if not c.ok:
                return {"node": name, "op": op, "output": out, **_plain(c),
                        "values_compared": compared}
    note = "no node diverges" if compared else "no intermediate value name is shared"
    return {"node": None, "values_compared": compared, "note": note}


def _plain(c: Comparison) -> dict[str, Any]:
    data = asdict(c)
    data["shape"] = list(c.shape)
    return data


def onnx_bytes(path: str) -> bytes:
    """The ONNX bytes onnxruntime is given for ``path``: the file itself, or a ``.keel``
    file exported to ONNX (keel/graph/export.py) with keel's fused forms decomposed."""
    from keel.formats.keel_format import is_keel_file, load_keel

    if not is_keel_file(path):
        try:
            with open(path, "rb") as fh:
                return fh.read()
        except OSError as exc:
            raise InvalidArgumentError(f"cannot read {path!r}: {exc.strerror}") from None
    from keel.graph.export import to_onnx
    from keel.graph.importers.onnx import KEEL_DOMAIN

    proto = to_onnx(load_keel(path))
    if any(o.domain == KEEL_DOMAIN for o in proto.opset_import):
        raise InvalidArgumentError(
            f"{path!r} uses keel ops with no ONNX spelling (domain {KEEL_DOMAIN}), which "
            f"onnxruntime cannot run; validate it with --against reference")
    return bytes(proto.SerializeToString())


def _ort_call(call: Callable[[], T]) -> T:
    """``call()``, with onnxruntime's own failures turned into one-line keel errors."""
    try:
        return call()
    except KeelError:
        raise
    except Exception as exc:  # onnxruntime raises its own exception types
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise ExecutionError(f"onnxruntime could not run the model: {first}") from None


def _ort_session(model_bytes: bytes) -> Any:
    try:
        import onnxruntime
    except ImportError:
        raise BackendSelectionError(
            "onnxruntime", "the onnxruntime package is not installed (pip install onnxruntime)"
        ) from None
    options = onnxruntime.SessionOptions()
    options.graph_optimization_level = onnxruntime.GraphOptimizationLevel.ORT_DISABLE_ALL
    return _ort_call(lambda: onnxruntime.InferenceSession(
        model_bytes, options, providers=["CPUExecutionProvider"]))


def _ort_intermediates(model_bytes: bytes, feeds: Mapping[str, np.ndarray],
                       ) -> tuple[dict[str, Any], list[Any]]:
    """Run onnxruntime with every node output exposed as a graph output."""
    import onnx
    from onnx import shape_inference

    proto = shape_inference.infer_shapes(onnx.load_from_string(model_bytes))
    typed = {vi.name: vi for vi in [*proto.graph.value_info, *proto.graph.output]}
    present = {o.name for o in proto.graph.output}
    nodes = []
    for node in proto.graph.node:
        nodes.append((node.name or node.output[0], node.op_type, list(node.output)))
        for out in node.output:
            if out and out in typed and out not in present:
                proto.graph.output.append(typed[out])
                present.add(out)
    session = _ort_session(proto.SerializeToString())
    names = [o.name for o in session.get_outputs()]
    values = _ort_call(lambda: session.run(names, dict(feeds)))
    return dict(zip(names, values, strict=True)), nodes


def _print(report: Mapping[str, Any]) -> None:
    console = Console()
    table = Table(title=f"{report['model']} on keel ({report['backend']}) vs {report['against']}")
    for col in ("output", "shape", "max abs", "max rel", "rel L2", "ok"):
        table.add_column(col, no_wrap=True)
    for o in report["outputs"]:
        table.add_row(o["name"], str(tuple(o["shape"])), f"{o['max_abs_error']:.3g}",
                      f"{o['max_rel_error']:.3g}", f"{o['rel_l2_error']:.3g}",
                      "yes" if o["ok"] else "[red]no[/red]")
    console.print(table)
    console.print(f"tolerance: rtol {report['rtol']}, atol {report['atol']}",
                  markup=False, highlight=False)
    if "first_divergence" in report:
        d = report["first_divergence"]
        if d["node"] is None:
            console.print(f"per node: {d['note']} ({d['values_compared']} values compared)",
                          markup=False, highlight=False)
        else:
            console.print(
                f"per node: first divergence at node {d['node']!r} ({d['op']}), output "
                f"{d['output']!r}: max abs {d['max_abs_error']:.3g}, rel L2 "
                f"{d['rel_l2_error']:.3g}", markup=False, highlight=False)
