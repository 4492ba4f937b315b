"""``keel drop MODEL --profile edge|server [--quantize int8] [--hardware FILE] [--out DIR]``:
a deployable, deterministic drop.

The drop (``OUT/PROFILE/DROP-ID/``, see :mod:`keel.planning.drops`) holds the
model converted to ``.keel`` (optimized at level ``all``, weights quantized with
``--quantize int8``), ``plan.json`` (the runtime plan and the model's plan for
the target hardware, every decision with its reason), ``flags.txt`` (the
runtime build flags, keel settings for the target and, for a GGUF model, the
llama.cpp command-line flags) and ``manifest.yaml``. The target hardware is
this machine (its stable readings: no free memory, clocks or temperatures) or
the profile ``--hardware`` names. ``keel run DROP`` runs it.
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path
from typing import Any

import typer
from rich.console import Console
from rich.table import Table

from keel.errors import InvalidArgumentError
from keel.hardware.profile import HardwareProfile
from keel.planning.drops import (
    DEFAULT_ARTIFACTS_DIR,
    Drop,
    Source,
    drop_id,
    drop_inputs,
    hardware_fingerprint,
    stable_profile,
    write_drop,
)
from keel.planning.policy import RuntimePolicy
from keel.planning.runtime_plan import RuntimePlan, is_this_machine, plan_runtime, with_llama_cpp
from keel.planning.targets import TargetProfile, get_target

__all__ = ["build_drop", "drop_command", "register"]

#: the performance hint each target profile plans with
PROFILE_HINTS = {"edge": "latency", "server": "throughput"}


def register(app: typer.Typer) -> None:
    app.command("drop")(drop_command)


def drop_command(
    model: Path = typer.Argument(..., help="The model file the drop is for (.onnx, .keel, "
                                           ".gguf)."),
    profile: str = typer.Option(..., "--profile", help="Target profile: edge or server."),
    out: Path = typer.Option(Path(DEFAULT_ARTIFACTS_DIR), "--out",
                             help="Artifacts root; the drop goes to OUT/PROFILE/DROP-ID/."),
    quantize: str | None = typer.Option(None, "--quantize",
                                        help="int8: store Conv/Gemm/MatMul weights as int8."),
    hardware: Path | None = typer.Option(
        None, "--hardware", help="Plan for a profile saved by `keel probe --json` (else this "
                                 "machine)."),
    policy: Path | None = typer.Option(None, "--policy", help="A RuntimePolicy YAML file."),
    context: int | None = typer.Option(None, "--context", help="GGUF: the context length "
                                       "to plan the KV cache for (else the model's)."),
    as_json: bool = typer.Option(False, "--json", help="Print JSON."),
) -> None:
    """Write MODEL converted, planned for the target and hashed into a drop (same inputs,
    same bytes); `keel run DROP` runs it."""
    drop = build_drop(model, profile, out, quantize=quantize, hardware=hardware,
                      policy=policy, context=context)
    if as_json:
        typer.echo(json.dumps(drop.to_dict(), indent=2))
        return
    Console().print(_table(drop))


def build_drop(model: str | Path, profile: str, out: str | Path = DEFAULT_ARTIFACTS_DIR, *,
               quantize: str | None = None, hardware: str | Path | None = None,
               policy: str | Path | None = None, context: int | None = None) -> Drop:
    """Convert, plan and write the drop of ``model`` for target ``profile``."""
    from keel.planning.gguf import is_gguf_file

    target = get_target(profile)
    quant = _check_quantize(quantize)
    target_hw = _target_hardware(hardware)
    runtime_policy = RuntimePolicy.resolve(policy, hint=PROFILE_HINTS[target.name])
    gguf = Path(model).is_file() and is_gguf_file(model)
    if not gguf:
        _check_model(Path(model))
    elif quant is not None:
        raise InvalidArgumentError("--quantize applies to ONNX and .keel models; a GGUF model "
                                   "keeps the quantization it was written with")
    extra = {
        "model_file": "model.gguf" if gguf else "model.keel",
        "quantize": quant,
        "context": context if gguf else None,
        "policy": runtime_policy.to_dict(),
        "hardware": {"fingerprint": hardware_fingerprint(target_hw),
                     "host": target_hw.hostname, "source": "this machine" if hardware is None
                     else "profile file"},
    }
    inputs = drop_inputs(model, target, extra)
    runtime = plan_runtime(target_hw, runtime_policy, local=is_this_machine(target_hw))
    with tempfile.TemporaryDirectory(prefix="keel-drop-") as work:
        header = _header(drop_id(inputs), target, runtime)
        if gguf:
            files = _gguf_files(Path(model), target_hw, runtime_policy, runtime, header, context)
        else:
            files = _keel_files(Path(model), Path(work), quant, target_hw, runtime_policy,
                                runtime, header)
        return write_drop(out, inputs, files)


def _check_quantize(quantize: str | None) -> str | None:
    if quantize is None:
        return None
    if quantize.strip().lower() != "int8":
        raise InvalidArgumentError(f"--quantize {quantize!r} is not allowed; a drop quantizes "
                                   "to int8")
    return "int8"


def _target_hardware(hardware: str | Path | None) -> HardwareProfile:
    if hardware is not None:
        return HardwareProfile.load(str(hardware))
    from keel.hardware import probe

    return stable_profile(probe())


def _check_model(model: Path) -> None:
    """Refuse to package a file keel cannot load (ModelFormatError names what is wrong)."""
    from keel.formats.keel_format import is_keel_file, load_keel
    from keel.graph.importers.onnx import import_onnx

    if not model.is_file():
        return  # drop_inputs reports a missing file with its own message
    if is_keel_file(model):
        load_keel(model)
    else:
        import_onnx(model)


def _header(ident: str, target: TargetProfile, runtime: RuntimePlan) -> dict[str, Any]:
    return {"drop_id": ident, "profile": target.name, "target": runtime.target,
            "target_reason": runtime.target_reason}


def _keel_files(model: Path, work: Path, quantize: str | None, hardware: HardwareProfile,
                policy: RuntimePolicy, runtime: RuntimePlan,
                header: dict[str, Any]) -> dict[str, Source]:
    """The converted model, its plan and flags for an ONNX or .keel source."""
    from keel.cli.convert import convert_model
    from keel.execution.model import load_model
    from keel.graph.quantize import QuantizeOptions

    converted = work / "model.keel"
    options = None if quantize is None else QuantizeOptions(quantize)
    report = convert_model(model, converted, "all", quantize=options)
    loaded = load_model(str(converted), hardware=hardware, policy=policy, hint=policy.hint,
                        plan_cache=False)
    loaded.set_telemetry(None)      # a plan for the target, not this moment's free memory
    model_plan = loaded.plan.to_dict()
    adaptive = getattr(loaded, "adaptive_plan", None)
    model_plan["adaptive"] = None if adaptive is None else adaptive.to_dict()
    plan = {**header, "runtime": runtime.to_dict(), "model": model_plan,
            "conversion": {"optimization_level": "all",
                           "passes_applied": report["passes_applied"],
                           "quantization": report["quantization"]}}
    return {"model.keel": converted, "plan.json": _json(plan),
            "flags.txt": _flags(header, _keel_settings(runtime, policy), None)}


def _gguf_files(model: Path, hardware: HardwareProfile, policy: RuntimePolicy,
                runtime: RuntimePlan, header: dict[str, Any],
                context: int | None) -> dict[str, Source]:
    """The GGUF model as it is, its llama.cpp plan and flags."""
    from keel.planning.gguf import plan_llama_cpp, read_gguf

    llama = plan_llama_cpp(read_gguf(model), hardware, policy, context=context)
    runtime = with_llama_cpp(runtime, llama.selection())
    plan = {**header, "runtime": runtime.to_dict(), "llama_cpp": llama.to_dict()}
    return {"model.gguf": model, "plan.json": _json(plan),
            "flags.txt": _flags(header, _keel_settings(runtime, policy), llama.flags)}


def _keel_settings(runtime: RuntimePlan, policy: RuntimePolicy) -> list[str]:
    """The KEEL_* settings that reproduce the plan on the target."""
    threads = runtime.threads.choice
    lines = [f"KEEL_BACKEND={runtime.engine.choice}", f"KEEL_HINT={policy.hint}"]
    if threads.isdigit():
        lines.append(f"KEEL_THREADS={threads}")
    return lines


def _flags(header: dict[str, Any], settings: list[str], llama: tuple[str, ...] | None) -> bytes:
    target = get_target(header["profile"])
    lines = [f"# keel drop {header['drop_id']} for the {target.name} profile",
             "# runtime build (rustc)", *target.flags,
             "# keel settings (environment)", *settings]
    if llama is not None:
        lines += ["# llama.cpp", " ".join(llama)]
    return "".join(f"{line}\n" for line in lines).encode("utf-8")


def _json(data: Any) -> bytes:
    return (json.dumps(data, indent=2, ensure_ascii=True) + "\n").encode("utf-8")


def _table(drop: Drop) -> Table:
    """The model and the drop's files first; the profile's runtime-manager backends and build
    flags (rustc flags and feature gates, kept in the manifest for a native runtime build)
    last, in their own section."""
    state = "written" if drop.created else "already present, identical"
    table = Table(title=f"keel drop {drop.drop_id} ({state})", show_header=False,
                  title_justify="left")
    table.add_column("what", style="bold", no_wrap=True)
    table.add_column("value", overflow="fold")
    m = drop.manifest
    for label, value in (
        ("model", f"{m['model']['file']} ({m['model']['size_bytes']} bytes, "
                  f"sha256 {m['model']['sha256'][:16]}…)"),
        ("profile", f"{drop.profile}: {m['description']}"),
        ("quantize", m["quantize"] or "no"),
        ("hardware", f"{m['hardware']['source']} ({m['hardware']['host'] or 'unnamed host'}, "
                     f"fingerprint {m['hardware']['fingerprint']})"),
        ("path", drop.path),
        ("files", ", ".join(f"{name} ({facts['size_bytes']} bytes)"
                            for name, facts in m["files"].items())),
        ("run it", f"keel run {drop.path}"),
    ):
        table.add_row(label, value)
    table.add_section()
    table.add_row("runtime manager", ", ".join(m["primary_backends"]) or "-")
    table.add_row("rustc flags", " ".join(m["flags"]) or "-")
    table.add_row("feature gates", ", ".join(m["feature_gates"]) or "-")
    return table
