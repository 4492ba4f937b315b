"""The benchmark machinery runs end to end on a tiny model (speed is never asserted)."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import numpy as np
import pytest
from typer.testing import CliRunner

from benchmarks import dispatch
from benchmarks import run as suite
from keel.bench import BenchConfig, bench_model, peak_rss_delta, random_feeds, settle
from keel.errors import InvalidArgumentError
from keel.execution.model import load_model
from keel.testing.cli import printed_json
from keel.testing.models import mlp

pytest.importorskip("onnxruntime", reason="the side-by-side bench compares with onnxruntime")

TINY = BenchConfig(batches=(1, 3), threads=(1,), passes=2, min_pass_seconds=0.0, min_iters=2)


def tiny_model() -> bytes:
    return mlp(in_features=8, hidden=(16,), classes=3).SerializeToString()


def test_bench_model_measures_keel_and_onnxruntime_side_by_side() -> None:
    messages: list[str] = []
    report = bench_model("tiny", tiny_model(), TINY, progress=messages.append)
    runtimes = {(m.runtime, m.batch, m.threads) for m in report.measurements}
    assert runtimes == {(r, b, 1) for r in ("keel:cpu", "onnxruntime") for b in (1, 3)}
    for m in report.measurements:
        assert m.samples >= 2 * TINY.passes and m.median_ms > 0 and m.p90_ms >= m.median_ms
        assert m.throughput == pytest.approx(m.batch * 1e3 / m.median_ms)
    assert set(report.ratios) == {"b1_t1", "b3_t1"} and all(r > 0 for r in
                                                           report.ratios.values())
    assert set(report.load_ms) == {"keel:cpu", "onnxruntime"}
    assert messages == ["tiny: batch 1, 1 thread(s)", "tiny: batch 3, 1 thread(s)"]
    assert json.loads(report.to_json())["model"] == "tiny"


def test_bench_without_a_comparison_times_keel_alone() -> None:
    config = BenchConfig(batches=(2,), passes=1, min_pass_seconds=0.0, min_iters=2, vs=None)
    report = bench_model("tiny", tiny_model(), config)
    assert [m.runtime for m in report.measurements] == ["keel:cpu"] and report.ratios == {}


def test_an_unknown_comparison_is_rejected() -> None:
    with pytest.raises(InvalidArgumentError, match="--vs 'tvm' is not supported"):
        bench_model("tiny", tiny_model(), BenchConfig(vs="tvm"))


def test_random_feeds_follow_the_model_inputs() -> None:
    feeds = random_feeds(load_model(tiny_model()).inputs, batch=4)
    assert feeds["x"].shape == (4, 8) and feeds["x"].dtype == np.float32


def test_the_suite_writes_json_and_a_ratio_table(tmp_path: Path) -> None:
    code = suite.main(["--models", "mlp", "--batches", "1", "--threads", "1", "--passes", "1",
                       "--pass-seconds", "0", "--no-rss", "--out", str(tmp_path)])
    assert code == 0
    [result] = tmp_path.glob("*.json")
    payload = json.loads(result.read_text())
    assert payload["machine"]["cpu"]["usable_cores"] >= 1
    assert [m["model"] for m in payload["models"]] == ["mlp"]
    table = (tmp_path / "latest.md").read_text()
    assert "| mlp |" in table and "b1_t1" in table
    # The files name the method: by default, settled blocks.
    assert payload["config"]["method"] == "settled"
    assert "Method: settled blocks" in table
    assert any("settled blocks: the other threads went idle" in n
               for n in payload["models"][0]["notes"])


def test_the_suite_can_alternate_blocks_back_to_back(tmp_path: Path) -> None:
    code = suite.main(["--models", "mlp", "--batches", "1", "--threads", "2", "--passes", "2",
                       "--pass-seconds", "0", "--no-rss", "--method", "blocks",
                       "--out", str(tmp_path)])
    assert code == 0
    [result] = tmp_path.glob("*.json")
    payload = json.loads(result.read_text())
    assert payload["config"]["method"] == "blocks"
    assert "b1_t2" in payload["models"][0]["ratios"]
    assert "Method: blocks" in (tmp_path / "latest.md").read_text()


def test_an_unknown_method_is_rejected() -> None:
    with pytest.raises(InvalidArgumentError, match="method 'interleaved'"):
        bench_model("tiny", tiny_model(), BenchConfig(method="interleaved"))


def test_settle_waits_for_the_other_threads_to_go_idle() -> None:
    """A thread busy for 0.3 s: settle() returns only once it has stopped."""
    if not Path("/proc/self/task").is_dir():
        pytest.skip("per-thread CPU time comes from /proc (Linux)")
    done = threading.Event()

    def busy() -> None:
        end = time.perf_counter() + 0.3
        while time.perf_counter() < end:
            sum(range(1000))
        done.set()

    worker = threading.Thread(target=busy)
    worker.start()
    try:
        settle(window_s=0.02, quiet_share=0.1, limit_s=10.0)
        assert done.is_set()
    finally:
        worker.join()
    assert settle(window_s=0.01, limit_s=10.0) < 10.0     # nothing else runs: it returns


def test_peak_rss_is_measured_in_fresh_processes(tmp_path: Path) -> None:
    path = tmp_path / "tiny.onnx"
    path.write_bytes(tiny_model())
    delta = peak_rss_delta(str(path), "keel:cpu")
    # keel, onnx and the model take memory beyond a process with numpy alone.
    assert delta > 0


def test_dispatch_overhead_is_measured() -> None:
    result = dispatch.measure(nodes=4, ops=("Relu",))
    assert set(result["Relu"]) == {"predict_1_node_us", "per_node_us", "kernel_us",
                                   "dispatch_us"}
    assert result["Relu"]["kernel_us"] > 0


def test_keel_bench_cli_prints_json(tmp_path: Path) -> None:
    from keel.cli import app

    path = tmp_path / "tiny.onnx"
    path.write_bytes(tiny_model())
    out = CliRunner().invoke(app, ["bench", str(path), "--vs", "onnxruntime", "--batch", "1",
                                   "--passes", "1", "--json"])
    assert out.exit_code == 0, out.output
    report = printed_json(out)
    assert {m["runtime"] for m in report["measurements"]} == {"keel:cpu", "onnxruntime"}


def test_the_gpu_suite_says_why_it_cannot_run_here(tmp_path: Path,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    """``--backend gpu`` times keel's gpu backend against torch on the same GPU
    (benchmarks.gpu); where either is missing it stops with one line naming what, and
    writes nothing."""
    from keel.backends.registry import default_registry

    if default_registry().availability("gpu").available:
        pytest.skip("a GPU is available: the suite would run")
    code = suite.main(["--backend", "gpu", "--models", "mlp", "--batches", "1",
                       "--threads", "1", "--passes", "1", "--out", str(tmp_path)])
    assert code == 2
    err = capsys.readouterr().err
    assert err.startswith("benchmarks.gpu: ") and ("torch" in err or "gpu backend" in err)
    assert not list(tmp_path.iterdir())


def test_bench_model_against_torch_on_the_same_graph() -> None:
    pytest.importorskip("torch", reason="the torch comparison needs torch")
    config = BenchConfig(batches=(1, 3), threads=(1,), passes=2, min_pass_seconds=0.0,
                         min_iters=2, vs="torch")
    report = bench_model("tiny", tiny_model(), config)
    runtimes = {(m.runtime, m.batch) for m in report.measurements}
    assert runtimes == {(r, b) for r in ("keel:cpu", "torch:cpu") for b in (1, 3)}
    assert set(report.ratios) == {"b1_t1", "b3_t1"} and all(r > 0 for r in
                                                           report.ratios.values())


def test_the_torch_graph_computes_what_onnxruntime_does() -> None:
    torch = pytest.importorskip("torch", reason="the torch reference needs torch")
    import onnxruntime as ort

    from benchmarks import zoo
    from keel.torch_graph import TorchGraph

    for name in ("lenet", "resnet20", "bert_mini"):
        data = zoo.build(name)
        feeds = zoo.MODELS[name].make_feeds(2)
        got = TorchGraph(data, device="cpu")({k: torch.from_numpy(v) for k, v in feeds.items()})
        want = ort.InferenceSession(data, providers=["CPUExecutionProvider"]).run(None, feeds)
        for out, ref in zip(got.values(), want, strict=True):
            np.testing.assert_allclose(out.numpy(), ref, rtol=1e-4, atol=1e-4)


def test_onnxruntime_without_the_cuda_provider_is_named() -> None:
    import onnxruntime as ort

    from keel.bench import _ort_session
    from keel.errors import BackendSelectionError
    from keel.testing.models import mlp

    if "CUDAExecutionProvider" in ort.get_available_providers():
        pytest.skip("onnxruntime-gpu is installed here")
    with pytest.raises(BackendSelectionError, match="CUDAExecutionProvider is not available"):
        _ort_session(mlp().SerializeToString(), 1, "gpu")


@pytest.mark.slow
def test_load_time_runs_end_to_end_on_a_small_model() -> None:
    # Fresh processes: a warm-up, then the load without the cache, a first and a second.
    from benchmarks import load_time

    report = load_time.measure("mlp", runs=1)
    assert report["reasons"]["first"].startswith("compiled plan stored in cache")
    assert report["reasons"]["second"].startswith("compiled plan loaded from cache")
    assert "cache" not in report["reasons"]["off"]
    assert set(report["in_process_s"]) == {"off", "first", "second"}
    assert report["fresh_process_ratio"] > 0


def test_the_tree_benchmark_writes_its_cases(tmp_path: Path) -> None:
    pytest.importorskip("sklearn", reason="scikit-learn trains the forests")
    pytest.importorskip("skl2onnx", reason="skl2onnx exports the forests")
    from benchmarks import trees

    assert trees.main(["--batch", "64", "--passes", "1", "--pass-seconds", "0.01",
                       "--out", str(tmp_path)]) == 0
    (written,) = tmp_path.glob("trees-*.json")
    payload = json.loads(written.read_text())
    assert payload["batch"] == 64
    assert [c["case"] for c in payload["cases"]] == [
        "random_forest_classifier_b64", "gradient_boosting_classifier_b64",
        "random_forest_regressor_b64"]
    assert all(c["keel_ms"] > 0 and c["onnxruntime_ms"] > 0 for c in payload["cases"])
