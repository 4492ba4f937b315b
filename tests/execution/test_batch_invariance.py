"""Batch invariance: a sample's output is bitwise the same at any batch size and any
chunking, on every benchmark model (docs/runtime.md, batch invariance).

The native kernels sum each output over the reduction in one order that depends only
on its depth, and the cpu planner picks conv variants from one image's shape
(``KEEL_BATCH_INVARIANT``, on by default). With ``KEEL_NATIVE=off`` the products run
on OpenBLAS, whose order of summation follows the product's shape: no bitwise
guarantee there, so those checks need the native tier.

The models are the benchmark suite's (benchmarks/zoo.py) at small inputs: ResNet-18
and MobileNetV2 on 64x64 images, BERT-mini on 16 tokens.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import onnx
import pytest

from keel import config, load_model, native

BATCH = 33
ROWS = (0, 1, 16, 32)


def _small(name: str) -> tuple[onnx.ModelProto, tuple[int, ...]]:
    from benchmarks import zoo

    if name == "bert_mini":
        return zoo.bert_mini(seq=16), (16,)
    spec = zoo.MODELS[name]
    proto, shape = spec.build(), spec.sample_shape
    if name in ("resnet18", "mobilenetv2"):
        dims = proto.graph.input[0].type.tensor_type.shape.dim
        dims[2].dim_value = dims[3].dim_value = 64
        shape = (3, 64, 64)
    return proto, shape


def _input(name: str, shape: tuple[int, ...], batch: int) -> np.ndarray:
    rng = np.random.default_rng(7)
    if name == "bert_mini":
        return rng.integers(0, 30522, size=(batch, *shape), dtype=np.int64)
    return rng.standard_normal((batch, *shape)).astype(np.float32)


def _out(model: Any, x: np.ndarray) -> np.ndarray:
    (out,) = model.predict({model.input_names[0]: x}).values()
    return np.asarray(out)


@pytest.fixture(autouse=True)
def _native_tier() -> None:
    if not native.available():
        pytest.skip("batch invariance is guaranteed on the native kernels: "
                    f"{native.status().reason}")


MODELS = ("mlp", "lenet", "resnet20", "resnet18", "mobilenetv2", "bert_mini")


@pytest.mark.parametrize("name", MODELS)
def test_a_sample_is_bitwise_the_same_alone_and_in_a_batch(name: str) -> None:
    proto, shape = _small(name)
    model = load_model(proto.SerializeToString(), backend="cpu", plan_cache=False)
    x = _input(name, shape, BATCH)
    whole = _out(model, x)
    for i in ROWS:
        alone = _out(model, x[i:i + 1])
        assert np.array_equal(alone[0], whole[i]), (
            f"{name}: row {i} differs by {np.max(np.abs(alone[0] - whole[i]))}")
    # and in a batch of another size, at another position
    assert np.array_equal(_out(model, x[5:12]), whole[5:12])


@pytest.mark.parametrize("name", MODELS)
def test_chunked_runs_equal_the_whole_batch_bitwise(name: str, tmp_path: Any,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KEEL_CACHE_DIR", str(tmp_path))    # the runtime history
    config.reload_settings()
    proto, shape = _small(name)
    data = proto.SerializeToString()
    x = _input(name, shape, BATCH)
    big = load_model(data, backend="cpu", plan_cache=False)
    whole = _out(big, x)
    small = load_model(data, backend="cpu", plan_cache=False)
    limit = (big.plan.peak_bytes + small.plan.peak_bytes) // 2
    chunked = load_model(data, backend="cpu", plan_cache=False, memory_limit=limit)
    assert np.array_equal(_out(chunked, x), whole)
    plan = chunked.adaptive_plan
    assert plan is not None and plan.chunked, "the limit did not force chunks"


def test_turned_off_the_planner_may_follow_the_batch(monkeypatch: pytest.MonkeyPatch) -> None:
    from keel.backends.cpu import planner
    from keel.backends.cpu.conv_rules import conv_case
    from keel.ops.registry import Op

    attrs = {"kernel_shape": [3, 3], "pads": [1, 1, 1, 1]}
    case = conv_case(Op.CONV, (33, 64, 16, 16), (64, 64, 3, 3), attrs, "float32")
    assert case is not None
    assert planner.deciding_case(case).batch == 1
    monkeypatch.setenv("KEEL_BATCH_INVARIANT", "off")
    config.reload_settings()
    try:
        assert planner.deciding_case(case).batch == 33
    finally:
        monkeypatch.delenv("KEEL_BATCH_INVARIANT")
        config.reload_settings()
