"""``InferenceSession``: onnxruntime's session over a keel :class:`~keel.execution.model.Model`."""

from __future__ import annotations

import datetime
import os
import re
import time
import warnings
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any

import numpy as np

from keel.errors import KeelError, ModelFormatError
from keel.onnxruntime._binding import IOBinding
from keel.onnxruntime._options import RunOptions, SessionOptions, not_honored
from keel.onnxruntime._providers import ProviderChoice, ProviderWarning, choose
from keel.onnxruntime._values import ModelMetadata, NodeArg, OrtValue, type_string, unwrap
from keel.onnxruntime.capi.onnxruntime_pybind11_state import (
    Fail,
    InvalidArgument,
    InvalidGraph,
    InvalidProtobuf,
    NoSuchFile,
    as_ort_error,
)
from keel.ops.types import ValueKind

__all__ = ["InferenceSession", "profile_file_name"]

_UNSAFE = re.compile(r"[^A-Za-z0-9._-]")


@contextmanager
def _ort_errors() -> Iterator[None]:
    """Re-raise keel's errors under onnxruntime's names."""
    try:
        yield
    except KeelError as exc:
        translated = as_ort_error(exc)
        if translated is exc:
            raise
        raise translated from None


def profile_file_name(prefix: str, when: datetime.datetime) -> str:
    """onnxruntime's profile file name, ``<prefix>_<date>_<time>.json``, in the working
    folder: the prefix keeps only its last path part and the characters
    ``A-Za-z0-9._-``, so the file never lands outside the folder."""
    base = _UNSAFE.sub("_", os.path.basename(str(prefix).replace("\\", "/")))
    base = base.lstrip(".") or "onnxruntime_profile_"
    return f"{base}_{when:%Y-%m-%d_%H-%M-%S}_{when.microsecond // 1000:03d}.json"


def _source(path_or_bytes: Any) -> Any:
    """What ``load_model`` reads; a missing file is onnxruntime's ``NoSuchFile``."""
    if isinstance(path_or_bytes, (str, os.PathLike)):
        path = os.fspath(path_or_bytes)
        if not os.path.isfile(path):
            raise NoSuchFile(f"Load model from {path} failed: file doesn't exist")
        return path
    if isinstance(path_or_bytes, (bytes, bytearray, memoryview)):
        return bytes(path_or_bytes)
    raise InvalidArgument(f"Unable to load from type '{type(path_or_bytes)}': give a path "
                          "or the model's bytes")


class InferenceSession:
    """onnxruntime's ``InferenceSession`` running on keel.

    ``InferenceSession(path_or_bytes, sess_options=None, providers=None,
    provider_options=None)``; ``session.model`` is the keel
    :class:`~keel.execution.model.Model` underneath and ``session.explain()`` its plan,
    headed by how the providers were resolved.
    """

    def __init__(self, path_or_bytes: str | os.PathLike[str] | bytes,
                 sess_options: SessionOptions | None = None,
                 providers: Sequence[Any] | None = None,
                 provider_options: Sequence[Mapping[str, Any]] | None = None,
                 **kwargs: Any) -> None:
        if sess_options is not None and not isinstance(sess_options, SessionOptions):
            raise InvalidArgument(f"sess_options must be a keel.onnxruntime.SessionOptions, "
                                  f"got {type(sess_options).__name__}")
        for key in kwargs:
            not_honored(f"InferenceSession argument {key}", "keel has no such setting")
        self._options = sess_options if sess_options is not None else SessionOptions()
        self._options.report_not_honored()
        self._choice = _choose_or_cpu(providers, provider_options)
        self._model = self._load(_source(path_or_bytes))
        self._profile_start_ns = time.time_ns() if self._options.enable_profiling else 0
        self._write_optimized_model()

    def _load(self, src: Any) -> Any:
        from keel.execution.model import load_model

        options = self._options
        try:
            return load_model(src, backend=self._choice.backend,
                              optimization_level=options.graph_optimization_level.keel_level,
                              threads=options.keel_threads(),
                              enable_profiling=options.enable_profiling)
        except ModelFormatError as exc:
            # onnxruntime tells bytes that are no ONNX model from a graph it cannot load.
            unparsed = "not a valid ONNX protobuf" in exc.message or "is empty" in exc.message
            raise (InvalidProtobuf if unparsed else InvalidGraph)(exc.message) from None
        except KeelError as exc:
            raise as_ort_error(exc) from None

    def _write_optimized_model(self) -> None:
        path = self._options.optimized_model_filepath
        if not path:
            return
        if str(path).endswith(".ort"):
            not_honored("SessionOptions.optimized_model_filepath in ORT format",
                        "keel writes the optimized model as ONNX only")
            return
        import onnx

        from keel.graph.export import to_onnx

        try:
            with _ort_errors():
                onnx.save(to_onnx(self._model.graph), path)
        except OSError as exc:
            raise Fail(f"cannot write the optimized model to {path!r}: {exc}") from None

    # ---- description -----------------------------------------------------
    @property
    def model(self) -> Any:
        """The keel :class:`~keel.execution.model.Model` this session runs."""
        return self._model

    def input_names(self) -> list[str]:
        return [i.name for i in self._model.inputs]

    def get_inputs(self) -> list[NodeArg]:
        """The inputs to feed (inputs with a default initializer are in
        ``get_overridable_initializers``)."""
        return [_node_arg(i.name, i.shape, i.dtype, i.kind) for i in self._model.inputs]

    def get_outputs(self) -> list[NodeArg]:
        return [_node_arg(o.name, o.shape, o.dtype, o.kind) for o in self._model.outputs]

    def get_overridable_initializers(self) -> list[NodeArg]:
        """Graph inputs that have a default value: feeding them overrides it."""
        graph = self._model.graph
        optional = set(graph.optional_input_names)
        return [_node_arg(v.name, v.type.shape, v.type.dtype) for v in graph.inputs
                if v.name in optional]

    def get_modelmeta(self) -> ModelMetadata:
        return ModelMetadata.from_graph(self._model.graph.metadata)

    def get_providers(self) -> list[str]:
        return list(self._choice.providers)

    def get_provider_options(self) -> dict[str, dict[str, str]]:
        return {name: dict(options) for name, options in self._choice.options.items()}

    def get_session_options(self) -> SessionOptions:
        return self._options

    def get_profiling_start_time_ns(self) -> int:
        return self._profile_start_ns

    def explain(self) -> str:
        """How the providers were resolved, then the keel model's ``explain()``."""
        head = "\n".join(f"provider: {r}" for r in self._choice.reasons)
        return f"{head}\n{self._model.explain()}"

    def set_providers(self, providers: Sequence[Any] | None = None,
                      provider_options: Sequence[Mapping[str, Any]] | None = None) -> None:
        """Re-place the model for ``providers`` (as at construction)."""
        choice = _choose_or_cpu(providers, provider_options)
        with _ort_errors():
            self._model.set_backend(choice.backend)
        self._choice = choice

    # ---- running ---------------------------------------------------------
    def run(self, output_names: Sequence[str] | None, input_feed: Mapping[str, Any],
            run_options: RunOptions | None = None) -> list[np.ndarray]:
        """The outputs named (all when ``None`` or empty), in that order."""
        feeds = self._feeds(input_feed, run_options)
        with _ort_errors():
            return list(self._model.run(output_names or None, feeds))

    def run_with_ort_values(self, output_names: Sequence[str] | None,
                            input_dict_ort_values: Mapping[str, OrtValue],
                            run_options: RunOptions | None = None) -> list[OrtValue]:
        """``run`` with ``OrtValue`` feeds and results."""
        for name, value in _items(input_dict_ort_values):
            if not isinstance(value, OrtValue):
                raise InvalidArgument(f"input {name!r} must be an OrtValue, got "
                                      f"{type(value).__name__}")
        return [OrtValue(a) for a in self.run(output_names, input_dict_ort_values, run_options)]

    def io_binding(self) -> IOBinding:
        return IOBinding(self)

    def run_with_iobinding(self, iobinding: IOBinding,
                           run_options: RunOptions | None = None) -> None:
        """Run on the binding's inputs; its outputs hold the results."""
        if not isinstance(iobinding, IOBinding) or iobinding.session is not self:
            raise InvalidArgument("IOBinding must be used with the session that created it "
                                  f"(this session's io_binding()), got {iobinding!r}")
        names = iobinding.output_names()
        iobinding.store(self.run(names, iobinding.feeds(), run_options))

    def end_profiling(self) -> str:
        """Write the Chrome trace to ``<profile_file_prefix>_<date>_<time>.json`` in the
        working folder and return its name; ``""`` when not profiling."""
        if self._model.profiler is None:
            return ""
        name = profile_file_name(self._options.profile_file_prefix, datetime.datetime.now())
        with _ort_errors():
            return os.path.basename(self._model.end_profiling(name))

    def _feeds(self, input_feed: Mapping[str, Any],
               run_options: RunOptions | None) -> dict[str, Any]:
        if run_options is not None and run_options.terminate:
            raise Fail("Exiting due to terminate flag being set to true.")
        if not isinstance(input_feed, Mapping):
            raise InvalidArgument(f"input_feed must be a dict of input name -> array, got "
                                  f"{type(input_feed).__name__}")
        missing = [n for n in self.input_names() if n not in input_feed]
        if missing:
            raise InvalidArgument(f"Required inputs ({missing}) are missing from input feed "
                                  f"({list(input_feed)}).")
        return {name: unwrap(value, name) for name, value in input_feed.items()}


def _items(feed: Any) -> list[tuple[str, Any]]:
    if not isinstance(feed, Mapping):
        raise InvalidArgument(f"input feed must be a dict, got {type(feed).__name__}")
    return list(feed.items())


def _node_arg(name: str, shape: Sequence[Any] | None, dtype: Any,
              kind: ValueKind = ValueKind.TENSOR) -> NodeArg:
    if kind is not ValueKind.TENSOR:        # onnxruntime gives a sequence or optional no shape
        return NodeArg(name, [], type_string(dtype, kind))
    return NodeArg(name, [] if shape is None else list(shape), type_string(dtype))


def _choose_or_cpu(providers: Sequence[Any] | None,
                   provider_options: Sequence[Mapping[str, Any]] | None) -> ProviderChoice:
    """The providers' keel backend; a malformed list falls back to the CPU with a warning,
    as onnxruntime does."""
    try:
        return choose(providers, provider_options)
    except InvalidArgument as exc:
        warnings.warn(f"EP Error {exc.message} when using {providers!r}; falling back to "
                      "['CPUExecutionProvider']", ProviderWarning, stacklevel=3)
        fallback = choose(["CPUExecutionProvider"])
        return ProviderChoice(fallback.backend, fallback.providers, fallback.options,
                              (f"providers {providers!r} rejected: {exc.message}",
                               *fallback.reasons))
