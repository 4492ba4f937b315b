"""RuntimePolicy: the knobs that turn a HardwareProfile into a RuntimePlan.

The first five fields and their defaults are exactly the runtime-manager
policy of the design (seed 000)::

    prefer_gpu: true
    min_gpu_memory_gb: 8.0
    prefer_lightweight_python_on_low_memory: true
    lightweight_memory_threshold_gb: 6.0
    allow_accelerator_experiments: true

keel adds two pins, both ``auto`` by default: ``backend`` (``gpu``, ``cpu``,
``reference``) and ``precision`` (``fp32``, ``fp16``, ``int8``, ...). A pin is
authoritative: a plan that cannot honour it raises ``BackendSelectionError``.
``hint`` is a performance hint, ``none`` by default: ``latency`` or
``throughput`` (see :mod:`keel.planning.adaptive`).

A policy comes from a YAML file, keyword arguments or ``KEEL_*`` environment
variables (``KEEL_`` + the upper-case field name, e.g. ``KEEL_MIN_GPU_MEMORY_GB``,
``KEEL_BACKEND``; read and validated once by :mod:`keel.config`).
:meth:`RuntimePolicy.resolve` layers them: defaults, then the file, then the
environment, then keyword arguments. Unknown keys and wrong
types raise :class:`~keel.errors.InvalidArgumentError` naming the key.
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from keel.config import BACKEND_NAMES, HINTS, PRECISIONS, Settings, settings
from keel.errors import InvalidArgumentError

__all__ = ["ENV_PREFIX", "SEED_FIELDS", "RuntimePolicy"]

#: the fields of seed 000's RuntimePolicy, in its order
SEED_FIELDS = (
    "prefer_gpu",
    "min_gpu_memory_gb",
    "prefer_lightweight_python_on_low_memory",
    "lightweight_memory_threshold_gb",
    "allow_accelerator_experiments",
)
ENV_PREFIX = "KEEL_"

_CHOICES = {"backend": BACKEND_NAMES, "precision": PRECISIONS, "hint": HINTS}


@dataclass(frozen=True)
class RuntimePolicy:
    """How to choose engines and runtimes for a machine (seed 000, plus keel's pins)."""

    prefer_gpu: bool = True
    min_gpu_memory_gb: float = 8.0
    prefer_lightweight_python_on_low_memory: bool = True
    lightweight_memory_threshold_gb: float = 6.0
    allow_accelerator_experiments: bool = True
    backend: str = "auto"
    precision: str = "auto"
    hint: str = "none"

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            object.__setattr__(self, f.name, _check(f.name, getattr(self, f.name), f.default))

    # --- construction ---------------------------------------------------------
    @classmethod
    def from_mapping(cls, data: Mapping[str, Any], where: str = "policy") -> RuntimePolicy:
        """A policy from a mapping; unknown keys and wrong types name the key."""
        if not isinstance(data, Mapping):
            raise InvalidArgumentError(
                f"{where} must be a mapping of policy keys, got {type(data).__name__}"
            )
        known = [f.name for f in dataclasses.fields(cls)]
        for key in data:
            if key not in known:
                raise InvalidArgumentError(
                    f"unknown key {key!r} in {where}; allowed: {', '.join(known)}"
                )
        return cls(**dict(data))

    @classmethod
    def from_kwargs(cls, **kwargs: Any) -> RuntimePolicy:
        """``RuntimePolicy.from_kwargs(prefer_gpu=False)``; like the constructor, typed errors."""
        return cls.from_mapping(kwargs, where="keyword arguments")

    @classmethod
    def from_yaml(cls, text: str, where: str = "policy YAML") -> RuntimePolicy:
        """A policy from YAML text; an empty document gives the defaults."""
        import yaml  # lazily: 1.3 MB a model load never needs

        try:
            data = yaml.safe_load(text)
        except yaml.YAMLError as exc:
            raise InvalidArgumentError(f"{where} is not valid YAML: {exc}") from None
        return cls.from_mapping({} if data is None else data, where=where)

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> RuntimePolicy:
        """Read a policy file (YAML, or JSON which YAML reads too)."""
        try:
            with open(path, encoding="utf-8") as fh:
                text = fh.read()
        except (OSError, UnicodeDecodeError, TypeError) as exc:
            raise InvalidArgumentError(f"cannot read policy file {str(path)!r}: {exc}") from None
        return cls.from_yaml(text, where=f"policy file {str(path)!r}")

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None,
                 base: RuntimePolicy | None = None) -> RuntimePolicy:
        """``base`` (default: the defaults) with every ``KEEL_<FIELD>`` variable applied.

        ``env`` None: the process's settings (:func:`keel.config.settings`);
        a mapping: the settings it gives (``Settings.from_env``).
        """
        return cls.from_settings(settings() if env is None else Settings.from_env(env), base)

    @classmethod
    def from_settings(cls, values: Settings, base: RuntimePolicy | None = None) -> RuntimePolicy:
        """``base`` (default: the defaults) with every policy field ``values`` sets applied."""
        start = cls() if base is None else base
        return dataclasses.replace(start, **values.policy_overrides())

    @classmethod
    def resolve(cls, path: str | os.PathLike[str] | None = None,
                env: Mapping[str, str] | None = None, **overrides: Any) -> RuntimePolicy:
        """Defaults, then the file at ``path``, then ``KEEL_*`` env, then ``overrides``."""
        policy = cls() if path is None else cls.load(path)
        policy = cls.from_env(env, base=policy)
        if overrides:
            merged = {**policy.to_dict(), **overrides}
            policy = cls.from_mapping(merged, where="keyword arguments")
        return policy

    # --- views ------------------------------------------------------------------
    @property
    def pinned_backend(self) -> str | None:
        """The pinned engine, or None in ``auto`` mode."""
        return None if self.backend == "auto" else self.backend

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def to_json(self, indent: int | None = 2) -> str:
        return json.dumps(self.to_dict(), indent=indent)

    def to_yaml(self) -> str:
        import yaml  # lazily: 1.3 MB a model load never needs

        return yaml.safe_dump(self.to_dict(), sort_keys=False)


def _check(name: str, value: Any, default: Any) -> Any:
    """Validate one field against the type of its default; floats accept ints."""
    if isinstance(default, bool):
        if not isinstance(value, bool):
            raise InvalidArgumentError(
                f"policy key {name!r} must be true or false, got {value!r}"
            )
        return value
    if isinstance(default, float):
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise InvalidArgumentError(
                f"policy key {name!r} must be a number of GiB, got {value!r}"
            )
        if not value >= 0 or value == float("inf"):
            raise InvalidArgumentError(
                f"policy key {name!r} must be a finite number >= 0, got {value!r}"
            )
        return float(value)
    allowed = _CHOICES[name]
    if not isinstance(value, str) or value.strip().lower() not in allowed:
        raise InvalidArgumentError(
            f"policy key {name!r} must be one of {', '.join(allowed)}, got {value!r}"
        )
    return value.strip().lower()
