"""The 16-thread parallelism audit: the benchmark models planned for a 16-core server
keep 16 threads evenly busy in every pass with work for them (convs, pooling, the native
GEMM's tile grids, row and copy kernels), explain() gives each conv's split, and the
planner's split of a pass is the one its kernel makes."""

from __future__ import annotations

import json
from typing import Any

import numpy as np
import pytest

from benchmarks import threads_audit
from keel import load_model, native
from keel.backends.cpu import conv_gemm, native_gemm, native_window
from keel.backends.cpu import planner as cpu_planner
from keel.backends.cpu.conv_epilogue import activation
from keel.hardware.fakes import fake_profile
from keel.ops.registry import Op
from keel.ops.schemas.conv import conv_geometry

SIXTEEN = 16


@pytest.fixture(autouse=True)
def _native_tier() -> None:
    if not (native_gemm.available() and native_window.ready()):
        pytest.skip(f"native tier unavailable: {native.status().reason}")


@pytest.fixture(scope="module")
def server() -> Any:
    return fake_profile(threads_audit.SERVER)


@pytest.mark.parametrize(("model", "batch"), [("resnet18", 1), ("resnet18", 32),
                                              ("mobilenetv2", 1), ("mobilenetv2", 32),
                                              ("resnet20", 32), ("bert_mini", 1),
                                              ("bert_mini", 32), ("mlp", 32)])
def test_every_pass_with_the_work_keeps_sixteen_threads_evenly_busy(model: str, batch: int,
                                                                    server: Any) -> None:
    assert server.cpu.physical_cores == SIXTEEN and server.cpu.l2_cache_bytes
    rows = threads_audit.audit(model, batch, SIXTEEN, server)
    judged = [(row, s) for row in rows for s in row.splits if s.worth(SIXTEEN)]
    assert judged, "no pass with work for 16 threads"
    short = [f"{row.node}: {s.describe()}" for row, s in judged
             if s.spread(SIXTEEN) > cpu_planner.EVEN_SPLIT]
    assert not short, short
    # Every conv has its passes modelled (none falls through to "not modelled").
    assert all(row.splits for row in rows if row.op is Op.CONV)


@pytest.mark.parametrize(("model", "batch", "piped"), [("resnet18", 32, 10), ("resnet18", 1, 4)])
def test_winograd_convs_run_as_evenly_split_pipelines(model: str, batch: int, piped: int,
                                                      server: Any) -> None:
    """At 16 threads the suite's Winograd convs with tiles for every thread run as the
    per-thread pipeline, each one pass whose blocks keep the threads evenly busy; the
    others keep the passes, with the planner's reason."""
    rows = threads_audit.audit(model, batch, SIXTEEN, server)
    convs = [r for r in rows if r.variant == "winograd"]
    pipes = [r for r in convs if r.pipeline]
    assert convs and len(pipes) >= piped, threads_audit.winograd_line(rows)
    for row in pipes:                    # counted in tiles: the last block may be short
        (split,) = row.splits
        assert split.unit == "tile(s)" and split.largest
        assert split.pieces == SIXTEEN and split.spread(SIXTEEN) <= cpu_planner.EVEN_SPLIT
    for row in convs:
        assert not row.failed, row.line()
    line = threads_audit.winograd_line(rows)
    assert line is not None and f"{len(pipes)} of {len(convs)} Winograd" in line


@pytest.mark.parametrize("threads", [2, 3, 4])
def test_pipelines_are_judged_in_tiles_on_few_threads(threads: int, server: Any) -> None:
    """The pipeline's pass counts tiles, so blocks even in number but not in tiles fail
    (ResNet-18's 128-channel conv at batch 1 in blocks of 64 on two threads: 128 tiles
    against 68); the planner's blocks pass on 2, 3 and 4 threads."""
    tiles = 14 * 14
    old = min(cpu_planner._busiest(tiles, 64, 2, last) for last in (False, True))
    uneven = cpu_planner.Split("pipeline (4 blocks of 64)", tiles, 2, 1 << 30, 1,
                               largest=old, unit="tile(s)")
    row = threads_audit.Row("resnet18", 1, "x", Op.CONV, "winograd", "", (uneven,), 2)
    assert row.failed and "1.31x the mean" in uneven.describe()
    rows = threads_audit.audit("resnet18", 1, threads, server)
    pipes = [r for r in rows if r.variant == "winograd" and r.pipeline]
    assert any(r.splits[0].units == tiles for r in pipes), threads_audit.winograd_line(rows)
    assert not any(r.failed for r in pipes), [r.line() for r in pipes if r.failed]


def test_explain_gives_each_conv_its_split(server: Any) -> None:
    model = load_model(threads_audit.fixed_batch(
        threads_audit.build("resnet20"),
        threads_audit.MODELS["resnet20"].make_feeds(32)),
        backend="cpu", threads=SIXTEEN, hardware=server, plan_cache=False)
    convs = [n for n in model.plan.nodes if n.op == "conv"]
    assert convs
    for node in convs:
        assert node.plan is not None
        assert "split into" in node.plan.reason("threads"), node.name
    one = load_model(threads_audit.build("resnet20"), backend="cpu", threads=1,
                     plan_cache=False)
    assert not any("split into" in n.plan.reason("threads")
                   for n in one.plan.nodes if n.plan is not None)


def test_the_audit_script_lists_what_it_judges(capsys: pytest.CaptureFixture[str]) -> None:
    assert threads_audit.main(["--models", "lenet", "--batches", "32", "--all"]) == 0
    out = capsys.readouterr().out
    assert "MaxPool_8" in out and "little work" in out
    assert "Winograd" not in out                  # LeNet has none: no line for them


@pytest.mark.parametrize(("x", "taps"), [((1, 960, 7, 7), 3), ((32, 144, 56, 56), 3),
                                         ((4, 32, 112, 112), 3), ((2, 576, 14, 14), 5)])
@pytest.mark.parametrize("threads", [2, 3, 16])
def test_the_depthwise_split_is_the_kernels(x: tuple[int, ...], taps: int,
                                            threads: int) -> None:
    c = x[1]
    w = np.zeros((c, 1, taps, taps), np.float32)
    geo = conv_geometry(Op.CONV, x, w.shape, {"group": c, "pads": (taps // 2,) * 4})
    layout = cpu_planner.depthwise_layout(geo)
    assert layout.native is not None
    xs, y = np.zeros(x, np.float32), np.zeros(geo.out_shape, np.float32)
    bound = native_window.bind_depthwise_conv(xs, w, None, None, y, layout.native, None,
                                              threads)
    split_over = bound.fn is native_window._functions().dwconv_mt
    kernel = bound.args[-1] if split_over else 1           # (..., planes, parts) when split
    (split,) = cpu_planner.conv_splits("depthwise", "native|x", None, geo, threads)
    assert split.units == x[0] * c
    assert split.pieces == kernel
    assert split_over == (kernel > 1)


@pytest.mark.parametrize(("x", "w", "attrs"), [
    ((1, 160, 7, 7), (960, 160, 1, 1), {}),
    ((1, 64, 14, 14), (384, 64, 1, 1), {}),
    ((1, 64, 56, 56), (128, 64, 3, 3), {"pads": (1, 1, 1, 1), "strides": (2, 2)}),
    ((4, 32, 28, 28), (32, 32, 3, 3), {"pads": (1, 1, 1, 1)}),
])
@pytest.mark.parametrize("threads", [2, 4, 16])
def test_the_product_split_is_the_native_gemms(x: tuple[int, ...], w: tuple[int, ...],
                                               attrs: dict[str, Any], threads: int) -> None:
    geo = conv_geometry(Op.CONV, x, w, {"pads": (0, 0, 0, 0), "strides": (1, 1), **attrs})
    form, _ = cpu_planner.native_form(geo)
    layout = conv_gemm.native_layout(geo, form)
    xs = np.zeros(x, np.float32)
    y = np.zeros(geo.out_shape, np.float32)
    filters = conv_gemm.native_filters(np, geo, np.zeros(w, np.float32), None)
    source = conv_gemm.native_source(np, layout, xs)
    calls = conv_gemm.native_calls(layout, source, xs, filters, None, y, activation("", ()))
    assert calls
    product = next(s for s in cpu_planner.conv_splits("native", form, None, geo, threads)
                   if s.product)
    for call in calls:
        if isinstance(call, native_gemm.BandCall):
            assert product.units == call.units
            continue
        split = call._split(threads)
        assert (1 if split is None else split[-1]) == product.pieces
        if split is not None:
            assert split[-2] == product.units


def test_the_audit_derives_the_least_work_from_another_machines_costs(
        tmp_path: Any, capsys: pytest.CaptureFixture[str]) -> None:
    """--thread-costs: the 16-core Xeon's measured costs (a 6.4 us dispatch on 16
    threads) ask more copy work of each thread than declared, so BERT-mini's head
    transposes at batch 32 split into fewer pieces than the threads."""
    from keel.backends.cpu import thread_costs

    costs = {"dispatch_us": {str(t): [us, us, us, 200] for t, us in
                             ((2, 2.63), (4, 3.27), (8, 4.64), (16, 6.42))},
             "rates_per_ns": {name: [rate, rate, rate, 200] for name, rate in
                              (("gemm", 71.7), ("window", 11.7), ("fastmath", 0.92),
                               ("copy", 0.70), ("winograd", 4.18))},
             "cpu": "a 16-core Xeon", "cores": SIXTEEN, "seconds": 0.04}
    path = tmp_path / "costs.json"
    path.write_text(json.dumps({"costs": costs}))
    try:
        assert threads_audit.main(["--models", "bert_mini", "--batches", "32", "--all",
                                   "--thread-costs", str(path)]) == 0
    finally:
        thread_costs.forget()
    out, err = capsys.readouterr()
    assert f"read from {path}" in err
    transposes = [line for line in out.splitlines() if "Transpose_" in line]
    assert transposes and all("split into 4 piece(s)" in line for line in transposes)
    assert "Gather_4" in out and "little work" in out.split("Gather_4")[1].splitlines()[0]
