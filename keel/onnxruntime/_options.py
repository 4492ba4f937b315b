"""``SessionOptions``, ``RunOptions`` and their enums, as onnxruntime spells them.

What maps to keel: ``intra_op_num_threads`` → the cpu backend's ``threads``,
``graph_optimization_level`` → keel's optimization levels, ``enable_profiling``
and ``profile_file_prefix`` → keel's profiler, ``optimized_model_filepath`` →
the optimized graph written as ONNX. Options keel cannot honor are kept (so a
script reads back what it set) and reported once each, with
:class:`OptionNotHonoredWarning`.
"""

from __future__ import annotations

import enum
import sys
import threading
import warnings
from collections.abc import Callable
from typing import Any

from keel._fork import renew_after_fork
from keel.onnxruntime.capi.onnxruntime_pybind11_state import Fail, InvalidArgument

__all__ = ["ExecutionMode", "ExecutionOrder", "GraphOptimizationLevel",
           "OptionNotHonoredWarning", "RunOptions", "SessionOptions", "not_honored"]


class OptionNotHonoredWarning(UserWarning):
    """An onnxruntime option or provider option that keel accepts but does not apply."""


_warned: set[str] = set()
_warned_lock = threading.Lock()
renew_after_fork(sys.modules[__name__], "_warned_lock")   # free in a forked child


def not_honored(option: str, why: str) -> None:
    """Warn, once per process and option, that keel does not apply ``option``."""
    with _warned_lock:
        if option in _warned:
            return
        _warned.add(option)
    warnings.warn(f"keel.onnxruntime: {option} is not honored: {why}",
                  OptionNotHonoredWarning, stacklevel=3)


class GraphOptimizationLevel(enum.IntEnum):
    """onnxruntime's graph optimization levels; each maps to one of keel's."""

    ORT_DISABLE_ALL = 0
    ORT_ENABLE_BASIC = 1
    ORT_ENABLE_EXTENDED = 2
    ORT_ENABLE_LAYOUT = 3
    ORT_ENABLE_ALL = 99

    @property
    def keel_level(self) -> str:
        """keel's ``optimization_level`` for this level."""
        return _KEEL_LEVELS[self]


_KEEL_LEVELS = {
    GraphOptimizationLevel.ORT_DISABLE_ALL: "none",
    GraphOptimizationLevel.ORT_ENABLE_BASIC: "basic",
    GraphOptimizationLevel.ORT_ENABLE_EXTENDED: "extended",
    GraphOptimizationLevel.ORT_ENABLE_LAYOUT: "all",
    GraphOptimizationLevel.ORT_ENABLE_ALL: "all",
}


class ExecutionMode(enum.IntEnum):
    """Sequential or parallel execution of independent nodes."""

    ORT_SEQUENTIAL = 0
    ORT_PARALLEL = 1


class ExecutionOrder(enum.IntEnum):
    """The order nodes are run in (keel runs its planned order)."""

    DEFAULT = 0
    PRIORITY_BASED = 1
    MEMORY_EFFICIENT = 2


class _Checked:
    """A ``SessionOptions`` attribute whose assignments are checked by ``check``."""

    def __init__(self, check: Callable[[Any, str], Any], default: Any, doc: str) -> None:
        self._check, self._default, self.__doc__ = check, default, doc

    def __set_name__(self, owner: type, name: str) -> None:
        self._name = name

    def __get__(self, obj: Any, owner: type | None = None) -> Any:
        return self if obj is None else obj.__dict__.get(self._name, self._default)

    def __set__(self, obj: Any, value: Any) -> None:
        obj.__dict__[self._name] = self._check(value, self._name)


def _count(value: Any, option: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise InvalidArgument(f"{option} takes an int, got {value!r}")
    return value


def _enum_check(cls: type[enum.IntEnum]) -> Callable[[Any, str], Any]:
    def check(value: Any, option: str) -> Any:
        if isinstance(value, cls):
            return value
        raise InvalidArgument(f"SessionOptions.{option} takes a {cls.__name__}, got "
                              f"{value!r}; allowed: {', '.join(m.name for m in cls)}")
    return check


class _ConfigEntries:
    """String config entries by key, as ``SessionOptions`` and ``RunOptions`` keep them."""

    def __init__(self) -> None:
        self._config: dict[str, str] = {}

    def _add_entry(self, key: str, value: str) -> None:
        self._config[str(key)] = str(value)

    def _get_entry(self, key: str) -> str:
        if key not in self._config:
            raise Fail(f"{type(self).__name__} does not have configuration with key: {key}")
        return self._config[key]


class SessionOptions(_ConfigEntries):
    """onnxruntime's ``SessionOptions``: set attributes, pass to ``InferenceSession``.
    Its ``session.*`` config entries are kept; keel applies none of them."""

    add_session_config_entry = _ConfigEntries._add_entry
    get_session_config_entry = _ConfigEntries._get_entry

    intra_op_num_threads = _Checked(
        _count, 0, "Threads of the cpu backend's kernels; 0 (default): keel's own choice.")
    inter_op_num_threads = _Checked(
        _count, 0, "Threads running independent nodes at once (keel runs nodes in order).")
    graph_optimization_level = _Checked(
        _enum_check(GraphOptimizationLevel), GraphOptimizationLevel.ORT_ENABLE_ALL,
        "The graph passes to run, mapped to keel's optimization levels.")
    execution_mode = _Checked(_enum_check(ExecutionMode), ExecutionMode.ORT_SEQUENTIAL,
                              "Sequential or parallel execution (keel runs nodes in order).")

    def __init__(self) -> None:
        super().__init__()
        self.execution_order = ExecutionOrder.DEFAULT
        self.enable_profiling = False
        self.profile_file_prefix = "onnxruntime_profile_"
        self.optimized_model_filepath = ""
        self.log_severity_level = -1
        self.log_verbosity_level = 0
        self.logid = ""
        self.enable_cpu_mem_arena = True
        self.enable_mem_pattern = True
        self.enable_mem_reuse = True
        self.use_deterministic_compute = False
        self.use_per_session_threads = True
        self._dim_overrides: dict[str, int] = {}

    def add_free_dimension_override_by_name(self, dim_name: str, dim_value: int) -> None:
        """Keep a symbolic dimension's fixed size (keel plans each input signature anyway)."""
        self._dim_overrides[str(dim_name)] = _count(dim_value, "dim_value")

    def has_providers(self) -> bool:
        return False

    def keel_threads(self) -> int | None:
        """keel's ``threads`` argument: None lets keel choose."""
        return self.intra_op_num_threads if self.intra_op_num_threads > 0 else None

    def report_not_honored(self) -> None:
        """Warn once for each option set that keel does not apply."""
        checks = [
            (self.inter_op_num_threads > 1, "SessionOptions.inter_op_num_threads",
             "keel runs the nodes of a model in order; use keel's hint='throughput' to run "
             "a batch on several thread groups"),
            (self.execution_mode is ExecutionMode.ORT_PARALLEL, "SessionOptions.execution_mode "
             "ORT_PARALLEL", "keel runs the nodes of a model in order"),
            (self.execution_order is not ExecutionOrder.DEFAULT,
             "SessionOptions.execution_order", "keel runs its planned order"),
            (bool(self._config), "SessionOptions session config entries",
             f"keel applies none of {sorted(self._config)}"),
            (bool(self._dim_overrides), "SessionOptions.add_free_dimension_override_by_name",
             "keel plans every input signature when it first runs"),
            (self.use_deterministic_compute, "SessionOptions.use_deterministic_compute",
             "keel's kernels make no determinism promise beyond their own"),
        ]
        for applies, option, why in checks:
            if applies:
                not_honored(option, why)


class RunOptions(_ConfigEntries):
    """onnxruntime's ``RunOptions``: ``terminate`` stops a run before it starts."""

    add_run_config_entry = _ConfigEntries._add_entry
    get_run_config_entry = _ConfigEntries._get_entry

    def __init__(self) -> None:
        super().__init__()
        self.log_severity_level = -1
        self.log_verbosity_level = 0
        self.logid = ""
        self.terminate = False
        self.only_execute_path_to_fetches = False
