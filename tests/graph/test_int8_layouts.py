"""int8 activations kept channels-last through pointwise/depthwise chains and through
ResNet's dense convolutions, max pool and joins: the cpu planner's chains (each node's plan
names its layout, with the reason), and results bit for bit those of the NCHW plan, at
several thread counts, the reference backend's and onnxruntime's."""

from __future__ import annotations

import dataclasses
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import keel
from keel.backends.cpu import native_qgemm, planner
from keel.hardware.fakes import fake_profile
from keel.testing import models
from tests.graph.test_fuse_qdq import _folded_and_quantized

ort = pytest.importorskip("onnxruntime")


@pytest.fixture(scope="module", params=["mobilenet", "resnet", "resnet_narrow"])
def int8_model(request: pytest.FixtureRequest,
               tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Any]:
    """Two MobileNet blocks (the second's residual join inside the chain), or a small
    ResNet (stem, max pool, a basic block, a downsampling one), or one 16 channels wide
    (ResNet-20's first downsampling: its basic block stays NCHW, the join before the
    downsampling block starts the chain), BatchNorm folded, quantized by onnxruntime
    (QDQ, uint8 activations, int8 weights per channel)."""
    if request.param == "mobilenet":
        proto = models.mobilenet_block(channels=40, expansion=3, size=12, blocks=2)
    else:
        proto = models.resnet_stages(channels=32 if request.param == "resnet" else 16, size=20)
        proto.graph.name = request.param
    return _folded_and_quantized(tmp_path_factory.mktemp("int8_layouts"), proto, "qdq"), proto


def _layouts(model: Any) -> Counter[str]:
    return Counter(p.layout for p in model.plan.nodes
                   if p.op in ("qlinear_conv", "qlinear_add", "qlinear_global_avg_pool",
                               "max_pool"))


def test_the_plan_keeps_the_blocks_channels_last(int8_model: tuple[Path, Any]) -> None:
    if not native_qgemm.available():
        pytest.skip("the int8 kernels need the native tier")
    model = keel.load_model(str(int8_model[0]), threads=1)
    layouts = _layouts(model)
    if int8_model[1].graph.name == "resnet":
        _resnet_chain(model, layouts)
        return
    if int8_model[1].graph.name == "resnet_narrow":
        _narrow_resnet_chain(model, layouts)
        return
    # stem starts the chain; 2 x (expand, depthwise, project) and both joins inside; the
    # integer global average pool reads the last join's channels-last bytes and ends it
    assert layouts["nchw->nhwc"] >= 1 and layouts["nhwc->nhwc"] >= 3
    pool = next(p for p in model.plan.nodes if p.op == "qlinear_global_avg_pool")
    assert pool.layout == "nhwc->nchw" and layouts["nhwc->nchw"] == 1
    assert pool.plan is not None and "global average pool" in pool.plan.reason("layout")
    inside = [p for p in model.plan.nodes if p.layout == "nhwc->nhwc"]
    assert inside[0].plan is not None and "depthwise" in inside[0].plan.reason("layout")
    assert "channels-last chain" in model.explain()


def _resnet_chain(model: Any, layouts: Counter[str]) -> None:
    """The stem stays NCHW, the max pool starts the chain (its result transposed), every
    dense convolution and join is inside it and the global average pool ends it."""
    ops = {p.op: p for p in model.plan.nodes}
    assert ops["max_pool"].layout == "nchw->nhwc"
    convs = [p.layout for p in model.plan.nodes if p.op == "qlinear_conv"]
    assert convs == ["", *["nhwc->nhwc"] * 5]
    assert [p.layout for p in model.plan.nodes if p.op == "qlinear_add"] == ["nhwc->nhwc"] * 2
    assert ops["qlinear_global_avg_pool"].layout == "nhwc->nchw"
    assert layouts["nhwc->nchw"] == 1 and layouts["nchw->nhwc"] == 1
    reason = ops["max_pool"].plan.reason("layout")
    assert "5 dense convolutions" in reason and "max pools" in reason
    # each channels-last kernel's split is stated with its layout (the planner's choice)
    dense = [p for p in model.plan.nodes if p.op == "qlinear_conv" and p.layout]
    assert all("the indirect product, on 1 of 1 thread(s)" in p.plan.reason("layout")
               for p in dense)


def _narrow_resnet_chain(model: Any, layouts: Counter[str]) -> None:
    """The stem, max pool and 16-channel basic block stay NCHW; the join after it writes
    its value channels-last once for both convolutions of the downsampling block that read
    it (neither transposes it), and the global average pool ends the chain."""
    nodes = list(model.plan.nodes)
    assert [p.layout for p in nodes if p.op == "qlinear_conv"] == ["", "", "", *["nhwc->nhwc"] * 3]
    assert [p.layout for p in nodes if p.op == "qlinear_add"] == ["nchw->nhwc", "nhwc->nhwc"]
    assert layouts["nchw->nhwc"] == 1 and layouts["nhwc->nchw"] == 1
    join = next(p for p in nodes if p.op == "qlinear_add")
    assert "written channels-last once for its 2 readers" in join.plan.reason("layout")
    assert "once for its 2 readers" in model.explain()


def test_a_chain_nodes_threads_reason_states_its_channels_last_split(
        int8_model: tuple[Path, Any]) -> None:
    """On two threads a convolution whose channels-last kernel runs states that kernel's
    split (the one its layout reason gives); one whose NCHW kernel runs (outside a chain,
    or a stem that only starts one) its NCHW kernel's."""
    if not native_qgemm.available():
        pytest.skip("the int8 kernels need the native tier")
    model = keel.load_model(str(int8_model[0]), threads=2)
    convs = [p for p in model.plan.nodes if p.op == "qlinear_conv" and p.plan is not None]
    chained = [p for p in convs if "; its kernel" in p.plan.reason("layout")]
    assert chained
    for p in chained:
        threads = p.plan.reason("threads")
        assert "where the node's layout is NCHW" not in threads, p.name
        assert f"the node runs channels-last ({p.layout}), its kernel" in threads, p.name
        split = threads.split(f"({p.layout}), ", 1)[1]
        assert p.plan.reason("layout").endswith(split), p.name
    for p in convs:
        if p not in chained:
            assert "where the node's layout is NCHW" in p.plan.reason("threads"), p.name


def _depthwise_splits(path: Path, profile: Any) -> list[str]:
    """The split each channels-last depthwise convolution's layout reason states (the
    1x1 panels' reasons name their kernel: "its kernel, the 1x1 panels")."""
    model = keel.load_model(str(path), threads=2, hardware=profile, plan_cache=False)
    reasons = [p.plan.reason("layout") for p in model.plan.nodes
               if p.op == "qlinear_conv" and p.plan is not None]
    return [r.rsplit("; ", 1)[-1] for r in reasons if "; its kernel on " in r]


@pytest.mark.parametrize("int8_model", ["mobilenet"], indirect=True)
def test_a_plan_for_a_profile_splits_as_that_cpu_would(int8_model: tuple[Path, Any]) -> None:
    """The channels-last depthwise kernel splits by planes only with qlayout.c's AVX-512
    paths: a plan for a stated profile reads its CPU's features, not this machine's."""
    if not native_qgemm.available():
        pytest.skip("the int8 kernels need the native tier")
    path = int8_model[0]
    server = fake_profile("x86-avx512-server")
    simd = tuple(f for f in server.cpu.simd if not f.startswith("avx512"))
    avx2 = dataclasses.replace(server, cpu=dataclasses.replace(server.cpu, simd=simd))
    assert planner.int8_lanes(server) and not planner.int8_lanes(avx2)
    with_lanes, without = (_depthwise_splits(path, p) for p in (server, avx2))
    assert with_lanes and all("(image, 32-channel block) planes" in s for s in with_lanes)
    assert without and all("output rows" in s for s in without)


@pytest.mark.parametrize("threads", [1, 2, 3])
def test_channels_last_plan_gives_the_nchw_plans_bits(int8_model: tuple[Path, Any],
                                                      threads: int,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    path, proto = int8_model
    feeds = models.make_inputs(proto, batch=3, seed=7)
    chains = keel.load_model(str(path), threads=threads)
    monkeypatch.setattr(planner, "int8_layouts", lambda *args: {})
    nchw = keel.load_model(str(path), threads=threads)
    assert set(_layouts(nchw)) == {""}
    got, want = chains.predict(feeds), nchw.predict(feeds)
    for name, value in want.items():
        np.testing.assert_array_equal(got[name], value)
    # every value, the channels-last ones given back in the graph's order
    got, want = chains.intermediates(feeds), nchw.intermediates(feeds)
    assert got.keys() == want.keys()
    for name, value in want.items():
        np.testing.assert_array_equal(got[name], value, err_msg=name)


def test_channels_last_plan_agrees_with_the_reference_and_onnxruntime(
        int8_model: tuple[Path, Any]) -> None:
    path, proto = int8_model
    feeds = models.make_inputs(proto, batch=5, seed=3)
    got = keel.load_model(str(path), threads=2).predict(feeds)
    ref = keel.load_model(str(path), backend="reference").predict(feeds)
    options = ort.SessionOptions()
    options.intra_op_num_threads = 1
    session = ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
    want = dict(zip([o.name for o in session.get_outputs()], session.run(None, feeds),
                    strict=True))
    for name, value in want.items():
        # the pool before the classifier is onnxruntime's integer one: its bytes exactly
        np.testing.assert_array_equal(got[name], ref[name])
        np.testing.assert_array_equal(got[name], value)
