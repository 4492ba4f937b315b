"""``keel demo``: probe this machine, plan for it, and run the bundled model everywhere.

The bundled model is a digits classifier (8×8 images from scikit-learn's
digits data, an MLP exported to ONNX) with held-out samples it never saw. The
demo runs it on every available backend and prints accuracy, latency, the
placement and the reasons behind it.
"""

from __future__ import annotations

import dataclasses
import json
import statistics
import time
from dataclasses import dataclass
from importlib import resources
from typing import Any

import numpy as np
import typer
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from keel.backends.registry import default_registry
from keel.cli.plan import print_plan
from keel.cli.probe import print_profile
from keel.errors import KeelError
from keel.hardware import probe
from keel.planning.policy import RuntimePolicy
from keel.planning.runtime_plan import plan_runtime

__all__ = ["DemoResult", "demo_command", "load_demo_data", "register", "run_demo"]

MODEL_FILE = "digits_mlp.onnx"
DATA_FILE = "digits_holdout.npz"


def register(app: typer.Typer) -> None:
    app.command("demo")(demo_command)


@dataclass(frozen=True)
class DemoResult:
    backend: str
    accuracy: float | None
    median_ms: float | None          # whole held-out batch
    batch1_ms: float | None          # one sample
    error: str | None = None


def load_demo_data() -> tuple[bytes, np.ndarray, np.ndarray]:
    """The bundled model's bytes and its held-out samples (x, y)."""
    data = resources.files("keel") / "data"
    model = (data / MODEL_FILE).read_bytes()
    with (data / DATA_FILE).open("rb") as fh, np.load(fh) as npz:
        return model, npz["x"], npz["y"]


def run_demo(backends: list[str] | None = None, repeats: int = 5) -> tuple[list[DemoResult], Any]:
    """Run the bundled model on each backend; returns results and the auto model."""
    from keel.execution.model import load_model

    model_bytes, x, y = load_demo_data()
    names = backends or [b.name for b in default_registry().available()]
    results = []
    for name in names:
        try:
            model = load_model(model_bytes, backend=name)
            probs = model.predict({"pixels": x})["probabilities"]
            accuracy = float(np.mean(probs.argmax(axis=1) == y))
            whole = _median_ms(lambda m=model: m.predict({"pixels": x}), repeats)
            one = _median_ms(lambda m=model: m.predict({"pixels": x[:1]}), repeats * 4)
            results.append(DemoResult(name, accuracy, whole, one))
        except KeelError as exc:
            results.append(DemoResult(name, None, None, None, str(exc)))
    return results, load_model(model_bytes, backend="auto")


def _median_ms(fn: Any, repeats: int) -> float:
    fn()  # first run plans and compiles for this shape
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def demo_command(
    as_json: bool = typer.Option(False, "--json", help="Print JSON."),
) -> None:
    """Probe this machine, plan for it, then run the bundled digits model on every backend."""
    profile = probe()
    runtime_plan = plan_runtime(profile, RuntimePolicy.resolve(), local=True)
    results, auto_model = run_demo()
    skipped = {k: v.reason for k, v in default_registry().report().items() if not v.available}
    if as_json:
        typer.echo(json.dumps({
            "hardware": json.loads(profile.to_json()),
            "runtime": runtime_plan.to_dict(),
            "results": [dataclasses.asdict(r) for r in results],
            "unavailable": skipped,
            "plan": auto_model.plan.to_dict(),
        }, indent=2))
        return
    console = Console()
    print_profile(console, profile, notes=False)
    console.print()
    print_plan(console, runtime_plan)
    console.print()
    console.print(_results_table(results, skipped))
    console.print()
    typer.echo("placement chosen in auto mode, and why:")
    typer.echo(auto_model.explain())


def _results_table(results: list[DemoResult], skipped: dict[str, str]) -> Table:
    _, x, _ = load_demo_data()
    table = Table(title=f"bundled digits classifier: {len(x)} held-out samples")
    for col in ("backend", "accuracy", f"batch {len(x)} median ms", "batch 1 median ms"):
        table.add_column(col)
    for r in results:
        if r.error:
            table.add_row(r.backend, "-", "-", escape(f"failed: {r.error}"))
        else:
            table.add_row(r.backend, f"{r.accuracy:.1%}", f"{r.median_ms:.3f}",
                          f"{r.batch1_ms:.3f}")
    for name, why in skipped.items():
        table.add_row(name, "-", "-", escape(f"unavailable: {why}"))
    return table
