"""The small-shape benchmark models (benchmarks/zoo.py) run in keel as in onnxruntime,
and a signature's own plan does not run the shape arithmetic its inference computed."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

import keel
from benchmarks import zoo as bench_zoo
from benchmarks.exports import GPT2Shape, decode_feeds
from tests.graph.models import rel_l2

ort = pytest.importorskip("onnxruntime", reason="the models are checked against onnxruntime")


def _both(model: bytes | str, feeds: dict[str, np.ndarray]) -> tuple[list[np.ndarray],
                                                                      list[np.ndarray]]:
    ours = keel.load_model(model, backend="cpu").run(None, feeds)
    theirs = ort.InferenceSession(model, providers=["CPUExecutionProvider"]).run(None, feeds)
    return ours, theirs


@pytest.mark.parametrize("sequence", [1, 5])
def test_small_block_matches_onnxruntime(sequence: int) -> None:
    x = np.random.default_rng(sequence).standard_normal((1, sequence, 256)).astype(np.float32)
    ours, theirs = _both(bench_zoo.build("small_block"), {"hidden_states": x})
    assert ours[0].shape == (1, sequence, 256)
    assert rel_l2(ours[0], theirs[0]) <= 1e-4


def test_the_small_blocks_residual_layer_norms_fuse_at_any_sequence() -> None:
    """Its heads are split and merged by Reshapes with -1 on a symbolic sequence: the
    inferred sequence lets each residual Add + LayerNorm fuse, at batch 32 as at 1."""
    model = keel.load_model(bench_zoo.build("small_block"), backend="cpu")
    for batch in (1, 32):
        x = np.random.default_rng(batch).standard_normal((batch, 1, 256)).astype(np.float32)
        ours = model.predict({"hidden_states": x})["out"]
        theirs = ort.InferenceSession(bench_zoo.build("small_block"),
                                      providers=["CPUExecutionProvider"]).run(None, {
                                          "hidden_states": x})[0]
        assert rel_l2(ours, theirs) <= 1e-4
        ops = [str(node.op) for node in model.plan.nodes]
        assert ops.count("skip_layer_norm") == 2 and "layer_norm" not in ops


def test_a_decode_steps_shape_arithmetic_is_folded_into_its_plan(
        zoo: Callable[[str], Path]) -> None:
    path = str(zoo("gpt2_decoder"))
    shape = GPT2Shape()
    past = [np.ones((1, shape.heads, 4, shape.head_dim), np.float32)
            for _ in shape.past_names()]
    feeds = decode_feeds(shape, np.array([[5]], np.int64), past)
    model = keel.load_model(path, backend="cpu")
    model.predict(feeds)
    model.enable_profiling()
    ours = model.run(None, feeds)
    ran = {e.name for e in model.profiler.events} if model.profiler else set()
    shapes = [n.name for n in model.plan.nodes if n.op == "shape"]
    assert shapes and not ran & set(shapes)            # Shape nodes never ran
    assert len(ran) < len(model.plan.nodes) // 2
    theirs = ort.InferenceSession(path, providers=["CPUExecutionProvider"]).run(None, feeds)
    for got, want in zip(ours, theirs, strict=True):
        assert rel_l2(got, want) <= 1e-4


def test_intermediates_include_the_folded_values(zoo: Callable[[str], Path]) -> None:
    path = str(zoo("gpt2_decoder"))
    shape = GPT2Shape()
    feeds = decode_feeds(shape, np.array([[5, 6]], np.int64))
    model = keel.load_model(path, backend="cpu")
    values = model.intermediates(feeds)
    shapes = [n for n in model.graph.nodes if n.op.value == "shape"]
    assert shapes and all(n.outputs[0] in values for n in shapes)
    first = shapes[0]
    source = values.get(first.inputs[0], feeds.get(first.inputs[0]))
    if source is not None:
        assert list(values[first.outputs[0]]) == list(np.shape(source))
