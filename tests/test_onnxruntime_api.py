"""``keel.onnxruntime`` against onnxruntime: the same scripts, the same model files.

Every script below is written as an onnxruntime user writes it and takes the
module as its ``ort`` argument; each test runs it with the real onnxruntime and
with ``keel.onnxruntime`` and compares what comes back: outputs (within a
tolerance), names, shapes, types, metadata, providers and the errors raised.
"""

from __future__ import annotations

import ctypes
import json
import os
import types
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import keel.onnxruntime as kort
from keel.onnxruntime import _options
from keel.onnxruntime._session import profile_file_name
from keel.testing import models

ort = pytest.importorskip("onnxruntime")
onnx = pytest.importorskip("onnx")

RTOL, ATOL = 1e-4, 1e-5
BOTH = [pytest.param(ort, id="onnxruntime"), pytest.param(kort, id="keel")]


def _keel_has_cuda() -> bool:
    return "CUDAExecutionProvider" in kort.get_available_providers()


def _both(script: Callable[..., Any], *args: Any) -> tuple[Any, Any]:
    """``script`` run with onnxruntime, then with keel.onnxruntime."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return script(ort, *args), script(kort, *args)


def _close(ours: Any, theirs: Any) -> None:
    assert len(ours) == len(theirs)
    for a, b in zip(ours, theirs, strict=True):
        assert a.dtype == b.dtype and a.shape == b.shape
        np.testing.assert_allclose(a, b, rtol=RTOL, atol=ATOL)


@pytest.fixture(autouse=True)
def _fresh_warnings(monkeypatch: pytest.MonkeyPatch) -> None:
    # "warn once" is once per process: each test starts with none said yet.
    monkeypatch.setattr(_options, "_warned", set())


@pytest.fixture
def mlp_path(tmp_path: Path) -> Path:
    model = models.mlp(in_features=8, hidden=(16,), classes=4)
    model.doc_string = "a small classifier"
    model.domain = "org.example"
    model.model_version = 3
    model.graph.doc_string = "the graph"
    onnx.helper.set_model_props(model, {"author": "me", "source": "the user's own"})
    path = tmp_path / "mlp.onnx"
    onnx.save(model, str(path))
    return path


@pytest.fixture
def encoder_path(tmp_path: Path) -> Path:
    path = tmp_path / "encoder.onnx"
    onnx.save(models.transformer_encoder(vocab=50, seq=8, d_model=16, heads=2, layers=1),
              str(path))
    return path


@pytest.fixture
def overridable_path(tmp_path: Path) -> Path:
    """A model with a graph input that has an initializer (a default value)."""
    h = onnx.helper
    x = h.make_tensor_value_info("x", onnx.TensorProto.FLOAT, ["n", 3])
    b = h.make_tensor_value_info("b", onnx.TensorProto.FLOAT, [3])
    y = h.make_tensor_value_info("y", onnx.TensorProto.FLOAT, ["n", 3])
    graph = h.make_graph([h.make_node("Add", ["x", "b"], ["y"])], "g", [x, b], [y],
                         [onnx.numpy_helper.from_array(np.ones(3, np.float32), "b")])
    model = h.make_model(graph, opset_imports=[h.make_opsetid("", 17)])
    model.ir_version = 8
    path = tmp_path / "overridable.onnx"
    onnx.save(model, str(path))
    return path


def _x(batch: int = 3) -> np.ndarray:
    return np.random.default_rng(0).standard_normal((batch, 8)).astype(np.float32)


# ---- scripts as onnxruntime users write them ---------------------------------

def describe_and_run(ort: Any, path: Path, feeds: dict[str, np.ndarray]) -> dict[str, Any]:
    sess = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    meta = sess.get_modelmeta()
    return {
        "inputs": [(i.name, i.shape, i.type) for i in sess.get_inputs()],
        "outputs": [(o.name, o.shape, o.type) for o in sess.get_outputs()],
        "overridable": [(i.name, i.shape, i.type) for i in sess.get_overridable_initializers()],
        "meta": (meta.producer_name, meta.graph_name, meta.domain, meta.description,
                 meta.graph_description, meta.version, meta.custom_metadata_map),
        "providers": sess.get_providers(),
        "results": sess.run(None, feeds),
    }


def from_bytes_subset(ort: Any, path: Path, feeds: dict[str, np.ndarray]) -> list[Any]:
    sess = ort.InferenceSession(path.read_bytes())
    last = sess.get_outputs()[-1].name
    return [*sess.run([last], feeds), *sess.run([last, last], feeds)]


def with_options(ort: Any, path: Path, level: str, threads: int) -> list[Any]:
    so = ort.SessionOptions()
    so.intra_op_num_threads = threads
    so.inter_op_num_threads = 1
    so.graph_optimization_level = getattr(ort.GraphOptimizationLevel, level)
    so.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
    so.log_severity_level = 3
    so.add_session_config_entry("session.use_env_allocators", "1")
    sess = ort.InferenceSession(str(path), sess_options=so,
                                providers=["CPUExecutionProvider"])
    assert so.get_session_config_entry("session.use_env_allocators") == "1"
    return sess.run(None, {sess.get_inputs()[0].name: _x()})


def io_binding(ort: Any, path: Path) -> list[Any]:
    sess = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    x = _x()
    name, out = sess.get_inputs()[0].name, sess.get_outputs()[0].name
    binding = sess.io_binding()
    binding.bind_cpu_input(name, x)
    binding.bind_output(out)
    sess.run_with_iobinding(binding)
    by_name = binding.copy_outputs_to_cpu()
    got = binding.get_outputs()
    # into a preallocated OrtValue, from an OrtValue
    target = ort.OrtValue.ortvalue_from_shape_and_type([3, 4], np.float32, "cpu", 0)
    second = sess.io_binding()
    second.bind_ortvalue_input(name, ort.OrtValue.ortvalue_from_numpy(x))
    second.bind_ortvalue_output(out, target)
    sess.run_with_iobinding(second)
    # raw host pointers, read and written at run time
    buffer = np.zeros((3, 4), np.float32)
    third = sess.io_binding()
    third.bind_input(name, "cpu", 0, np.float32, [3, 8], x.ctypes.data)
    third.bind_output(out, "cpu", 0, np.float32, [3, 4], buffer.ctypes.data)
    sess.run_with_iobinding(third)
    return [*by_name, got[0].numpy(), target.numpy(), buffer,
            np.array(got[0].shape()), np.array([len(got)])]


def ort_values(ort: Any, path: Path) -> dict[str, Any]:
    x = _x()
    value = ort.OrtValue.ortvalue_from_numpy(x)
    sess = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    (result,) = sess.run_with_ort_values(None, {sess.get_inputs()[0].name: value})
    counts = np.arange(6, dtype=np.int64).reshape(2, 3)     # an OrtValue does not own it
    ints = ort.OrtValue.ortvalue_from_numpy(counts)
    return {
        "described": [(v.shape(), v.data_type(), v.device_name(), v.is_tensor(),
                       v.element_type()) for v in (value, result, ints)],
        "arrays": [np.array(v.numpy()) for v in (value, result, ints)],  # copies: the
        # NumPy arrays viewed are gone once this returns
        "type": type(result).__name__,
    }


def profiled(ort: Any, path: Path, prefix: str) -> dict[str, Any]:
    so = ort.SessionOptions()
    so.enable_profiling = True
    so.profile_file_prefix = prefix
    sess = ort.InferenceSession(str(path), so, providers=["CPUExecutionProvider"])
    sess.run(None, {sess.get_inputs()[0].name: _x()})
    name = sess.end_profiling()
    with open(name, encoding="utf-8") as fh:
        trace = json.load(fh)
    return {"name": name, "again": sess.end_profiling(), "trace": trace,
            "started": sess.get_profiling_start_time_ns() > 0}


def providers_without_cuda(ort: Any, path: Path, providers: list[Any]) -> list[str]:
    sess = ort.InferenceSession(str(path), providers=providers)
    return list(sess.get_providers())


def optimized_model(ort: Any, path: Path, out: Path) -> None:
    so = ort.SessionOptions()
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_EXTENDED
    so.optimized_model_filepath = str(out)
    ort.InferenceSession(str(path), so, providers=["CPUExecutionProvider"])


# ---- the comparisons ---------------------------------------------------------

def test_description_metadata_and_outputs_match(mlp_path: Path) -> None:
    theirs, ours = _both(describe_and_run, mlp_path, {"x": _x()})
    _close(ours.pop("results"), theirs.pop("results"))
    assert ours == theirs
    assert ours["meta"][-1] == {"author": "me", "source": "the user's own"}


def test_symbolic_dims_and_int_inputs_match(encoder_path: Path) -> None:
    model = onnx.load(str(encoder_path))
    theirs, ours = _both(describe_and_run, encoder_path, models.make_inputs(model, batch=2))
    _close(ours.pop("results"), theirs.pop("results"))
    assert ours == theirs
    assert any(isinstance(d, str) for _, shape, _ in ours["inputs"] for d in shape)


def test_overridable_initializers_match(overridable_path: Path) -> None:
    x = np.ones((2, 3), np.float32)
    theirs, ours = _both(describe_and_run, overridable_path, {"x": x})
    _close(ours.pop("results"), theirs.pop("results"))
    assert ours == theirs and ours["overridable"] == [("b", [3], "tensor(float)")]
    fed = {"x": x, "b": np.full(3, 5.0, np.float32)}
    theirs, ours = _both(describe_and_run, overridable_path, fed)
    _close(ours["results"], theirs["results"])
    np.testing.assert_allclose(ours["results"][0], 6.0)


def test_bytes_input_and_output_subset(mlp_path: Path) -> None:
    theirs, ours = _both(from_bytes_subset, mlp_path, {"x": _x()})
    _close(ours, theirs)


@pytest.mark.parametrize("level", ["ORT_DISABLE_ALL", "ORT_ENABLE_BASIC",
                                   "ORT_ENABLE_EXTENDED", "ORT_ENABLE_ALL"])
@pytest.mark.parametrize("threads", [0, 1, 2])
def test_session_options_threads_and_levels(mlp_path: Path, level: str, threads: int) -> None:
    theirs, ours = _both(with_options, mlp_path, level, threads)
    _close(ours, theirs)


def test_threads_and_level_reach_keel(mlp_path: Path) -> None:
    so = kort.SessionOptions()
    so.intra_op_num_threads = 1
    so.graph_optimization_level = kort.GraphOptimizationLevel.ORT_DISABLE_ALL
    sess = kort.InferenceSession(str(mlp_path), so)
    assert sess.model.optimization_level == "none"
    assert sess.model._threads == 1
    with pytest.raises(kort.capi.onnxruntime_pybind11_state.InvalidArgument,
                       match="graph_optimization_level takes a GraphOptimizationLevel"):
        so.graph_optimization_level = 5  # type: ignore[assignment]


def test_io_binding_matches(mlp_path: Path) -> None:
    theirs, ours = _both(io_binding, mlp_path)
    _close(ours, theirs)


def test_ort_values_round_trip(mlp_path: Path) -> None:
    theirs, ours = _both(ort_values, mlp_path)
    _close(ours.pop("arrays"), theirs.pop("arrays"))
    assert ours == theirs


def test_ort_value_wraps_the_array_without_copying() -> None:
    x = np.zeros(4, np.float32)
    value = kort.OrtValue.ortvalue_from_numpy(x)
    x[1] = 7.0
    assert value.numpy()[1] == 7.0 and value.data_ptr() == x.ctypes.data


def test_profiling_writes_a_chrome_trace_in_the_working_folder(
        mlp_path: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    theirs, ours = _both(profiled, mlp_path, "prof")
    for result in (theirs, ours):
        assert result["name"].startswith("prof_") and result["name"].endswith(".json")
        assert os.path.dirname(result["name"]) == "" and (tmp_path / result["name"]).is_file()
        assert result["again"] == "" and result["started"]
        assert {e["ph"] for e in result["trace"]} == {"X"}
        assert {"cat", "name", "ts", "dur", "args"} <= set(result["trace"][-1])
    nodes = [e for e in ours["trace"] if e["cat"] == "Node"]
    assert nodes and all(e["name"].endswith("_kernel_time") for e in nodes)


@pytest.mark.parametrize("prefix", ["../escape", "/tmp/abs/prof", "a b/../c", "..", "x\\..\\y"])
def test_profile_file_name_stays_in_the_working_folder(prefix: str) -> None:
    import datetime

    name = profile_file_name(prefix, datetime.datetime(2026, 1, 2, 3, 4, 5, 6000))
    assert os.sep not in name and "/" not in name and not name.startswith(".")
    assert name.endswith("_2026-01-02_03-04-05_006.json")


@pytest.mark.skipif(_keel_has_cuda(), reason="compares behaviour without CUDA")
@pytest.mark.parametrize("providers", [
    ["CUDAExecutionProvider", "CPUExecutionProvider"],
    ["CUDAExecutionProvider"],
    [("CUDAExecutionProvider", {"device_id": 0}), "CPUExecutionProvider"],
    ["CPUExecutionProvider"],
])
def test_providers_without_cuda_warn_and_fall_back_to_cpu(
        mlp_path: Path, providers: list[Any]) -> None:
    wants_cuda = any("CUDA" in str(p) for p in providers)
    results = []
    for module in (ort, kort):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            results.append(providers_without_cuda(module, mlp_path, providers))
        said = [str(w.message) for w in caught if issubclass(w.category, UserWarning)]
        cuda_warnings = [m for m in said if "Specified provider 'CUDAExecutionProvider' is "
                                            "not in available provider names" in m]
        assert bool(cuda_warnings) == wants_cuda
    assert results[0] == results[1] == ["CPUExecutionProvider"]


@pytest.mark.skipif(_keel_has_cuda(), reason="compares behaviour without CUDA")
def test_explain_says_why_a_provider_was_skipped(mlp_path: Path) -> None:
    with pytest.warns(kort.ProviderWarning):
        sess = kort.InferenceSession(str(mlp_path), providers=["CUDAExecutionProvider",
                                                               "CPUExecutionProvider"])
    explained = sess.explain()
    assert "provider: CUDAExecutionProvider skipped: keel backend 'gpu'" in explained
    assert "CPUExecutionProvider → keel backend cpu" in explained
    assert "model 'mlp'" in explained


def test_set_providers_and_provider_options(mlp_path: Path) -> None:
    for module in (ort, kort):
        sess = module.InferenceSession(str(mlp_path))
        sess.set_providers(["CPUExecutionProvider"])
        assert sess.get_providers() == ["CPUExecutionProvider"]
        assert sess.get_provider_options()["CPUExecutionProvider"] == {}
    sess = kort.InferenceSession(str(mlp_path))
    assert sess.model.backend == "auto"
    sess.set_providers(["CPUExecutionProvider"])
    assert sess.model.backend == "cpu"


def test_malformed_providers_fall_back_to_cpu_like_onnxruntime(mlp_path: Path) -> None:
    theirs, ours = _both(providers_without_cuda, mlp_path, [1])
    assert theirs == ours == ["CPUExecutionProvider"]


def test_optimized_model_is_written_as_onnx(mlp_path: Path, tmp_path: Path) -> None:
    ort_out, keel_out = tmp_path / "by_ort.onnx", tmp_path / "by_keel.onnx"
    optimized_model(ort, mlp_path, ort_out)
    optimized_model(kort, mlp_path, keel_out)
    x = {"x": _x()}
    # keel's optimized model is a plain ONNX model: onnxruntime itself runs it
    reference = ort.InferenceSession(str(mlp_path)).run(None, x)
    _close(ort.InferenceSession(str(keel_out)).run(None, x), reference)
    _close(kort.InferenceSession(str(keel_out)).run(None, x), reference)


def test_options_keel_cannot_honor_are_reported_once(mlp_path: Path) -> None:
    so = kort.SessionOptions()
    so.inter_op_num_threads = 4
    so.execution_mode = kort.ExecutionMode.ORT_PARALLEL
    with pytest.warns(kort.OptionNotHonoredWarning) as caught:
        kort.InferenceSession(str(mlp_path), so)
    said = [str(w.message) for w in caught]
    assert any("inter_op_num_threads is not honored" in m for m in said)
    assert any("ORT_PARALLEL is not honored" in m for m in said)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        kort.InferenceSession(str(mlp_path), so)        # said once already: quiet now


# ---- errors: raised where onnxruntime raises, caught the same way --------------

def _raised(module: Any, call: Callable[[Any], Any]) -> BaseException:
    with pytest.raises(Exception) as info:
        call(module)
    return info.value


def _same_kind(theirs: BaseException, ours: BaseException) -> bool:
    """onnxruntime's builtin errors: keel's is an instance; its own: keel's has its name."""
    if type(theirs).__module__ == "builtins":
        return isinstance(ours, type(theirs))
    return type(ours).__name__ == type(theirs).__name__


def _session(module: Any, path: Path) -> Any:
    return module.InferenceSession(str(path), providers=["CPUExecutionProvider"])


X = _x()
BAD_CALLS: dict[str, Callable[[Any, Path], Any]] = {
    "missing input": lambda m, p: _session(m, p).run(None, {}),
    "wrong input name": lambda m, p: _session(m, p).run(None, {"img": X}),
    "extra input name": lambda m, p: _session(m, p).run(None, {"x": X, "extra": X}),
    "wrong dtype": lambda m, p: _session(m, p).run(None, {"x": X.astype(np.float64)}),
    "wrong rank": lambda m, p: _session(m, p).run(None, {"x": X[0]}),
    "wrong fixed dim": lambda m, p: _session(m, p).run(None, {"x": np.ones((2, 9), np.float32)}),
    "a string feed": lambda m, p: _session(m, p).run(None, {"x": "zeros"}),
    "invalid output name": lambda m, p: _session(m, p).run(["nope"], {"x": X}),
    "missing file": lambda m, p: m.InferenceSession(str(p.parent / "absent.onnx")),
    "garbage bytes": lambda m, p: m.InferenceSession(b"\x08\x01garbage"),
    "terminated run": lambda m, p: _session(m, p).run(None, {"x": X}, _terminate(m)),
    "unknown config key": lambda m, p: m.SessionOptions().get_session_config_entry("k"),
    "binding no output": lambda m, p: _run_bound(_session(m, p)),
    "foreign binding": lambda m, p: _session(m, p).run_with_iobinding(
        _session(m, p).io_binding()),
    "binding unknown input": lambda m, p: _session(m, p).io_binding().bind_cpu_input("q", X),
}


def _run_bound(session: Any) -> None:
    binding = session.io_binding()
    binding.bind_cpu_input("x", X)
    session.run_with_iobinding(binding)


def _terminate(module: Any) -> Any:
    options = module.RunOptions()
    options.terminate = True
    return options


@pytest.mark.parametrize("case", list(BAD_CALLS))
def test_errors_are_raised_where_onnxruntime_raises(mlp_path: Path, case: str) -> None:
    call = BAD_CALLS[case]
    theirs = _raised(ort, lambda m: call(m, mlp_path))
    ours = _raised(kort, lambda m: call(m, mlp_path))
    assert _same_kind(theirs, ours), (case, type(theirs).__mro__, type(ours).__mro__)
    from keel.errors import KeelError

    assert isinstance(ours, KeelError), (case, ours)


def test_error_names_mirror_onnxruntime() -> None:
    state = kort.capi.onnxruntime_pybind11_state
    for name in ("Fail", "InvalidArgument", "NoSuchFile", "InvalidProtobuf", "InvalidGraph",
                 "NotImplemented", "RuntimeException", "EPFail"):
        assert hasattr(ort.capi.onnxruntime_pybind11_state, name)
        assert issubclass(getattr(state, name), RuntimeError)
    assert issubclass(state.InvalidArgument, ValueError)


def test_public_names_mirror_onnxruntime() -> None:
    names = ["InferenceSession", "SessionOptions", "RunOptions", "OrtValue", "IOBinding",
             "GraphOptimizationLevel", "ExecutionMode", "ExecutionOrder", "NodeArg",
             "ModelMetadata", "get_available_providers", "get_all_providers", "get_device",
             "get_version_string", "get_build_info", "__version__", "SessionIOBinding"]
    for name in names:
        assert hasattr(ort, name) and hasattr(kort, name), name
    for enum_name in ("GraphOptimizationLevel", "ExecutionMode"):
        ours, theirs = getattr(kort, enum_name), getattr(ort, enum_name)
        assert {m: int(ours[m]) for m in ours.__members__} == \
               {m: int(theirs.__members__[m]) for m in ours.__members__}
    assert kort.get_device() in ("CPU", "GPU")
    assert kort.get_available_providers()[-1] == "CPUExecutionProvider"
    assert isinstance(kort, types.ModuleType)


def test_bound_output_of_the_wrong_shape_is_a_typed_error(mlp_path: Path) -> None:
    sess = kort.InferenceSession(str(mlp_path))
    binding = sess.io_binding()
    binding.bind_cpu_input("x", _x())
    binding.bind_ortvalue_output("probs", kort.OrtValue.ortvalue_from_shape_and_type(
        [2, 4], np.float32))
    with pytest.raises(kort.capi.onnxruntime_pybind11_state.InvalidArgument,
                       match=r"output 'probs' is float32\[3, 4\] but was bound to "
                             r"tensor\(float\)\[2, 4\]"):
        sess.run_with_iobinding(binding)


def test_host_pointer_binding_reads_at_run_time(mlp_path: Path) -> None:
    sess = kort.InferenceSession(str(mlp_path))
    x = np.zeros((3, 8), np.float32)
    binding = sess.io_binding()
    binding.bind_input("x", "cpu", 0, np.float32, [3, 8],
                       ctypes.addressof(ctypes.c_char.from_address(x.ctypes.data)))
    binding.bind_output("probs")
    x[...] = _x()                       # changed after binding: the run sees it
    sess.run_with_iobinding(binding)
    _close(binding.copy_outputs_to_cpu(), sess.run(None, {"x": _x()}))


# ---- real models, and CUDA where keel has it -----------------------------------

def classify(ort: Any, model: bytes, batch: np.ndarray) -> list[Any]:
    sess = ort.InferenceSession(model, providers=["CPUExecutionProvider"])
    name = sess.get_inputs()[0].name
    (logits,) = sess.run(None, {name: batch})
    return [logits, np.argmax(logits, axis=1)]


@pytest.mark.parametrize("name", ["lenet", "resnet20"])
def test_zoo_models_classify_alike(name: str) -> None:
    from benchmarks import zoo

    spec = zoo.MODELS[name]
    theirs, ours = _both(classify, zoo.build(name), spec.make_input(2))
    _close(ours[:1], theirs[:1])


@pytest.mark.gpu
def test_cuda_provider_runs_on_keels_gpu_backend(mlp_path: Path) -> None:
    if not _keel_has_cuda():
        pytest.skip("keel's gpu backend cannot run here")
    sess = kort.InferenceSession(str(mlp_path), providers=["CUDAExecutionProvider",
                                                           "CPUExecutionProvider"])
    assert sess.get_providers() == ["CUDAExecutionProvider", "CPUExecutionProvider"]
    assert kort.get_device() == "GPU"
    assert "CUDAExecutionProvider → keel backend auto" in sess.explain()
    reference = ort.InferenceSession(str(mlp_path)).run(None, {"x": _x()})
    _close(sess.run(None, {"x": _x()}), reference)
    value = kort.OrtValue.ortvalue_from_numpy(_x(), "cuda", 0)
    assert value.device_name() == "cuda"
    (result,) = sess.run_with_ort_values(None, {"x": value})
    _close([result.numpy()], reference)


def test_a_keel_file_opens_with_the_onnx_models_metadata(mlp_path: Path, tmp_path: Path) -> None:
    from keel.formats.keel_format import save_keel
    from keel.graph.importers.onnx import import_onnx

    keel_path = tmp_path / "mlp.keel"
    save_keel(import_onnx(str(mlp_path)), keel_path)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from_onnx = describe_and_run(kort, mlp_path, {"x": _x()})
        from_keel = describe_and_run(kort, keel_path, {"x": _x()})
    _close(from_keel.pop("results"), from_onnx.pop("results"))
    assert from_keel == from_onnx
