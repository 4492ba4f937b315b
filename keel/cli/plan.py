"""``keel plan [MODEL] [--policy FILE] [--hardware FILE] [--hint HINT] [--context N] [--json]``:
where things run, and why.

With a GGUF MODEL: llama.cpp's plan from the file's metadata (layers offloaded
to the GPU, context, threads, batch, ``--mlock``; see :mod:`keel.planning.gguf`)
with its arithmetic, and the runtime plan whose llama.cpp row is that plan.

With MODEL: the model's per-node plan and its adaptive plan (precision plan,
streams, chunks, telemetry), under the performance hint ``--hint
latency|throughput`` (else the policy's). Without MODEL, or with ``--runtime``:
the runtime plan (seed 000's runtime-manager selections: llama.cpp, the Python
runtime, accelerators, keel's engine, the target class) for this machine, or
for a profile saved with ``keel probe --json`` on another one.
"""

from __future__ import annotations

import dataclasses
import importlib
import inspect
import json
from pathlib import Path
from typing import Any

import typer
from rich.console import Console
from rich.table import Table

from keel.errors import InvalidArgumentError, KeelError
from keel.hardware import probe
from keel.hardware.profile import HardwareProfile
from keel.planning.adaptive import check_hint
from keel.planning.gguf import is_gguf_file, plan_llama_cpp, read_gguf
from keel.planning.policy import RuntimePolicy
from keel.planning.runtime_plan import RuntimePlan, is_this_machine, plan_runtime, with_llama_cpp
from keel.planning.telemetry import take_snapshot

__all__ = ["plan_command", "plan_table", "print_plan", "register"]


def register(app: typer.Typer) -> None:
    app.command("plan")(plan_command)


def plan_command(
    model: str | None = typer.Argument(None, help="An ONNX or .keel model to plan."),
    policy: Path | None = typer.Option(None, "--policy", help="A RuntimePolicy YAML file."),
    hardware: Path | None = typer.Option(
        None, "--hardware", help="Plan for a profile saved by `keel probe --json`."),
    hint: str | None = typer.Option(
        None, "--hint", help="Performance hint: latency or throughput (else the policy's)."),
    runtime: bool = typer.Option(
        False, "--runtime", help="With MODEL, also show the runtime-manager plan "
                                 "(llama.cpp, Python runtime, accelerators)."),
    context: int | None = typer.Option(
        None, "--context", help="GGUF: the context length to plan the KV cache for "
                                "(else the model's trained length)."),
    as_json: bool = typer.Option(False, "--json", help="Print JSON."),
) -> None:
    """Plan MODEL's nodes (where each runs and why); a GGUF MODEL gets llama.cpp's flags;
    without MODEL, or with --runtime, the runtime-manager plan for this machine (or a saved
    profile)."""
    runtime_policy = RuntimePolicy.resolve(policy)
    if hint is not None:
        runtime_policy = dataclasses.replace(runtime_policy, hint=check_hint(hint, "--hint"))
    profile = probe() if hardware is None else HardwareProfile.load(str(hardware))
    local = hardware is None or is_this_machine(profile)
    runtime_plan = plan_runtime(profile, runtime_policy, local=local)
    if model is not None and is_gguf_file(model):
        _plan_gguf(model, profile, runtime_policy, runtime_plan, context, local, as_json)
        return
    if context is not None:
        raise InvalidArgumentError("--context applies to GGUF models (llama.cpp's KV cache)")
    loaded = None if model is None else _load(model, runtime_policy, profile)
    if as_json:
        data: dict[str, Any] = runtime_plan.to_dict()
        if loaded is not None:
            model_plan = loaded.plan.to_dict()
            adaptive = getattr(loaded, "adaptive_plan", None)
            model_plan["adaptive"] = None if adaptive is None else adaptive.to_dict()
            data = {"model": model_plan, "runtime": data}
        typer.echo(json.dumps(data, indent=2))
        return
    console = Console()
    if loaded is not None:
        typer.echo(loaded.explain())
    if loaded is None or runtime:
        if loaded is not None:
            console.print("runtime manager (llama.cpp, Python runtime, accelerators):",
                          style="bold", highlight=False)
        print_plan(console, runtime_plan)


def _plan_gguf(model: str, profile: HardwareProfile, policy: RuntimePolicy,
               runtime_plan: RuntimePlan, context: int | None, local: bool,
               as_json: bool) -> None:
    """llama.cpp's plan for a GGUF model: NVML's free GPU memory on this machine, the
    profile's for another."""
    telemetry = take_snapshot(profile) if local else None
    llama = plan_llama_cpp(read_gguf(model), profile, policy, context=context,
                           telemetry=telemetry)
    runtime_plan = with_llama_cpp(runtime_plan, llama.selection())
    if as_json:
        typer.echo(json.dumps({"llama_cpp": llama.to_dict(), "runtime": runtime_plan.to_dict()},
                              indent=2))
        return
    console = Console()
    m = llama.model
    console.print(f"{m.file}: {m.architecture}, {m.layers} layers, {m.quantization}, "
                  f"trained context {m.context_length}, {m.heads} heads / {m.kv_heads} KV heads, "
                  f"embedding {m.embedding}", markup=False, highlight=False, soft_wrap=True)
    console.print(llama.command(model), markup=False, highlight=False, soft_wrap=True)
    for reason in llama.reasons:
        console.print(f"  {reason}", markup=False, highlight=False, soft_wrap=True)
    print_plan(console, runtime_plan)


def _load(model: str, policy: RuntimePolicy, profile: HardwareProfile) -> Any:
    """Load and plan ``model`` through keel.execution (imported only when asked)."""
    try:
        load_model = importlib.import_module("keel.execution.model").load_model
    except (ImportError, AttributeError) as exc:
        raise KeelError(
            f"planning a model needs keel.execution.model.load_model, which this "
            f"installation lacks ({exc})"
        ) from None
    kwargs: dict[str, Any] = {"backend": policy.backend, "precision": policy.precision}
    accepted = inspect.signature(load_model).parameters
    kwargs.update({k: v for k, v in (("hardware", profile), ("policy", policy),
                                     ("hint", policy.hint)) if k in accepted})
    return load_model(model, **kwargs)


def print_plan(console: Console, runtime_plan: RuntimePlan) -> None:
    """The readable form of a runtime plan: the table, then rejected alternatives."""
    console.print(plan_table(runtime_plan))
    console.print(f"target {runtime_plan.target}: {runtime_plan.target_reason}",
                  markup=False, highlight=False, soft_wrap=True)
    for s in runtime_plan.selections:
        for name, why in s.rejected:
            console.print(f"{s.component}: rejected {name}: {why}",
                          markup=False, highlight=False, soft_wrap=True)


def plan_table(runtime_plan: RuntimePlan) -> Table:
    """One row per selection: choice, fallbacks, reason."""
    table = Table(title=f"keel plan: {runtime_plan.host or 'unknown host'} "
                        f"(target: {runtime_plan.target})", title_justify="left")
    table.add_column("component", style="bold", no_wrap=True)
    table.add_column("choice", no_wrap=True)
    table.add_column("fallbacks", no_wrap=True)
    table.add_column("why", overflow="fold")
    for s in runtime_plan.selections:
        choice = s.choice if not s.detail else f"{s.choice} ({s.detail})"
        table.add_row(s.component, choice, ", ".join(s.fallbacks) or "-", s.reason)
    return table
