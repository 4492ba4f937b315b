"""Execution providers → keel backends.

``CUDAExecutionProvider`` is keel's ``gpu`` backend and ``CPUExecutionProvider``
its ``cpu`` backend. As in onnxruntime, a provider that is not available here is
skipped with a ``UserWarning`` (the same text onnxruntime prints) and the
session runs on the CPU; every such decision is kept as a reason for
``InferenceSession.explain()``.
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from keel.onnxruntime._options import not_honored
from keel.onnxruntime.capi.onnxruntime_pybind11_state import InvalidArgument

__all__ = ["CPU", "CUDA", "ProviderChoice", "available_providers", "choose"]

CPU = "CPUExecutionProvider"
CUDA = "CUDAExecutionProvider"
_BACKENDS = {CUDA: "gpu", CPU: "cpu"}
# Provider options keel applies (anything else is reported once)
_APPLIED = {CUDA: {"device_id": "0"}, CPU: {}}
# onnxruntime's names of every provider it knows, for get_all_providers()
ALL_PROVIDERS = ("TensorrtExecutionProvider", CUDA, "MIGraphXExecutionProvider",
                 "OpenVINOExecutionProvider", "DnnlExecutionProvider", "CoreMLExecutionProvider",
                 "DmlExecutionProvider", "ROCMExecutionProvider", "QNNExecutionProvider", CPU)


class ProviderWarning(UserWarning):
    """A requested execution provider is not available here (onnxruntime warns the same)."""


def available_providers() -> list[str]:
    """The providers keel can run here, in priority order: CUDA when keel's gpu backend
    can run, and always CPU."""
    from keel.backends.registry import default_registry

    gpu = default_registry().availability("gpu")
    return [CUDA, CPU] if gpu.available else [CPU]


@dataclass(frozen=True)
class ProviderChoice:
    """What a providers list resolved to: keel's backend, the providers reported, their
    options and why."""

    backend: str
    providers: tuple[str, ...]
    options: Mapping[str, Mapping[str, str]]
    reasons: tuple[str, ...]


def _normalize(providers: Sequence[Any],
               provider_options: Sequence[Mapping[str, Any]] | None,
               ) -> list[tuple[str, dict[str, str]]]:
    """``(name, options)`` pairs from names or ``(name, dict)`` tuples, as onnxruntime
    checks them."""
    if isinstance(providers, str) or not isinstance(providers, Sequence):
        raise InvalidArgument("'providers' should be a sequence of provider names or "
                              f"(name, options) tuples, got {providers!r}")
    if provider_options is not None:
        if isinstance(provider_options, str) or not isinstance(provider_options, Sequence):
            raise InvalidArgument("'provider_options' should be a sequence.")
        if len(providers) != len(provider_options):
            raise InvalidArgument("'providers' and 'provider_options' should be the same "
                                  "length if both are given.")
        if not all(isinstance(p, str) for p in providers):
            raise InvalidArgument("Only string values for 'providers' are supported if "
                                  "'provider_options' is given.")
        if not all(isinstance(o, Mapping) for o in provider_options):
            raise InvalidArgument("'provider_options' values must be dicts.")
        pairs = list(zip(providers, provider_options, strict=True))
    else:
        pairs = [(p, {}) if isinstance(p, str) else p for p in providers]
        for p in pairs:
            if not (isinstance(p, tuple) and len(p) == 2 and isinstance(p[0], str)
                    and isinstance(p[1], Mapping)):
                raise InvalidArgument("'providers' values must be either strings or "
                                      f"(string, dict) tuples, got {p!r}")
    return [(name, {str(k): str(v) for k, v in opts.items()}) for name, opts in pairs]


def choose(providers: Sequence[Any] | None,
           provider_options: Sequence[Mapping[str, Any]] | None = None) -> ProviderChoice:
    """The keel backend for ``providers``: the first available one decides; ``None`` (or
    an empty list) lets keel place every node itself (``auto``)."""
    available = available_providers()
    if providers is None or (isinstance(providers, Sequence) and len(providers) == 0):
        return ProviderChoice("auto", tuple(available), {p: {} for p in available},
                              ("providers not given: keel places each node (backend auto)",))
    reasons: list[str] = []
    seen: dict[str, dict[str, str]] = {}
    for name, options in _normalize(providers, provider_options):
        if name in seen:
            warnings.warn(f"Duplicate provider '{name}' encountered, ignoring.",
                          ProviderWarning, stacklevel=3)
            continue
        if name not in available:
            warnings.warn(f"Specified provider '{name}' is not in available provider "
                          f"names.Available providers: '{', '.join(available)}'",
                          ProviderWarning, stacklevel=3)
            reasons.append(f"{name} skipped: {_why_unavailable(name)}")
            continue
        seen[name] = options
        _report_options(name, options)
    first = next(iter(seen), CPU)
    if not seen:
        reasons.append(f"no requested provider is available: falling back to {CPU}")
        seen[CPU] = {}
    if first == CUDA:
        # onnxruntime runs nodes CUDA lacks on the CPU: keel's auto chain does the same.
        reasons.append(f"{CUDA} → keel backend auto (gpu first, cpu where it pays or the "
                       "gpu lacks a kernel)")
        return ProviderChoice("auto", (CUDA, CPU), {CUDA: seen[CUDA], CPU: seen.get(CPU, {})},
                              tuple(reasons))
    # A CUDA listed after the CPU is registered but takes no node (the CPU takes them all).
    reasons.append(f"{CPU} → keel backend cpu")
    return ProviderChoice("cpu", tuple(seen), seen, tuple(reasons))


def _why_unavailable(name: str) -> str:
    backend = _BACKENDS.get(name)
    if backend is None:
        return "keel has no backend for this provider"
    from keel.backends.registry import default_registry

    return f"keel backend {backend!r}: {default_registry().availability(backend).reason}"


def _report_options(name: str, options: Mapping[str, str]) -> None:
    applied = _APPLIED.get(name, {})
    for key, value in options.items():
        if applied.get(key) != value:
            not_honored(f"{name} option {key}={value}",
                        "keel's backends take no provider options")
