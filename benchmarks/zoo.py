"""Reference models with random weights, built with onnx.helper.

MLP 784-512-256-10, a LeNet-style MNIST CNN, CIFAR ResNet-20, ResNet-18 and
MobileNetV2 at 3x224x224, and a BERT-mini encoder (4 layers, hidden 256,
4 heads, FFN 1024, sequence 128, token embedding). The graphs follow what
PyTorch exports at opset 17 (Conv+BatchNormalization, Gemm, Erf-form GELU,
LayerNormalization, unfused attention), so keel's passes have real work to do.

Two small-shape models time the fixed cost per call and per node: ``small_block``
(one attention + LayerNorm + GELU block of hidden 256 at any sequence; the suite
runs it at sequence 1) and ``gpt2_decode`` (a GPT-2 decode step exported with torch,
4 layers, hidden 256, vocabulary 8192, one new token after a cache of 64; needs
torch and transformers, so it runs only when named).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

__all__ = ["DEFAULT_MODELS", "MODELS", "ModelSpec", "build", "decode_feeds"]


class _Builder:
    """A tiny graph builder: named values, random He-initialised weights."""

    def __init__(self, name: str, seed: int = 0) -> None:
        self.name = name
        self.rng = np.random.default_rng(seed)
        self.nodes: list[onnx.NodeProto] = []
        self.inits: list[onnx.TensorProto] = []
        self.inputs: list[onnx.ValueInfoProto] = []
        self.outputs: list[onnx.ValueInfoProto] = []
        self._n = 0

    def fresh(self, base: str) -> str:
        self._n += 1
        return f"{base}_{self._n}"

    def init(self, arr: np.ndarray, base: str = "w") -> str:
        name = self.fresh(base)
        self.inits.append(numpy_helper.from_array(arr, name))
        return name

    def weight(self, shape: tuple[int, ...], fan_in: int) -> str:
        std = math.sqrt(2.0 / max(fan_in, 1))
        return self.init((self.rng.standard_normal(shape) * std).astype(np.float32))

    def const(self, values: object, dtype: type = np.int64) -> str:
        return self.init(np.asarray(values, dtype=dtype), "c")

    def node(self, op: str, inputs: list[str], **attrs: object) -> str:
        out = self.fresh(op.lower())
        self.nodes.append(helper.make_node(op, inputs, [out], name=self.fresh(op), **attrs))
        return out

    def input(self, name: str, shape: list[int | str], elem: int = TensorProto.FLOAT) -> str:
        self.inputs.append(helper.make_tensor_value_info(name, elem, shape))
        return name

    def output(self, value: str, name: str, shape: list[int | str]) -> None:
        self.nodes.append(helper.make_node("Identity", [value], [name], name=self.fresh("out")))
        self.outputs.append(helper.make_tensor_value_info(name, TensorProto.FLOAT, shape))

    # -- layers -----------------------------------------------------------
    def conv(self, x: str, cin: int, cout: int, k: int, stride: int = 1,
             group: int = 1, bias: bool = False) -> str:
        w = self.weight((cout, cin // group, k, k), fan_in=cin // group * k * k)
        ins = [x, w] + ([self.init(np.zeros(cout, np.float32), "b")] if bias else [])
        return self.node("Conv", ins, kernel_shape=[k, k], strides=[stride, stride],
                         pads=[k // 2] * 4, group=group)

    def bn(self, x: str, c: int) -> str:
        r = self.rng
        scale = self.init((1.0 + 0.1 * r.standard_normal(c)).astype(np.float32), "gamma")
        shift = self.init((0.1 * r.standard_normal(c)).astype(np.float32), "beta")
        mean = self.init((0.1 * r.standard_normal(c)).astype(np.float32), "mean")
        var = self.init((1.0 + 0.1 * r.random(c)).astype(np.float32), "var")
        return self.node("BatchNormalization", [x, scale, shift, mean, var], epsilon=1e-5)

    def conv_bn(self, x: str, cin: int, cout: int, k: int, stride: int = 1,
                group: int = 1, act: str | None = "Relu") -> str:
        y = self.bn(self.conv(x, cin, cout, k, stride, group), cout)
        if act == "Relu":
            return self.node("Relu", [y])
        if act == "Relu6":
            return self.node("Clip", [y, self.const(np.float32(0.0), np.float32),
                                      self.const(np.float32(6.0), np.float32)])
        return y

    def gemm(self, x: str, cin: int, cout: int) -> str:
        w = self.weight((cout, cin), fan_in=cin)
        b = self.init(np.zeros(cout, np.float32), "b")
        return self.node("Gemm", [x, w, b], transB=1)

    def linear(self, x: str, cin: int, cout: int) -> str:
        """MatMul + Add, as PyTorch exports nn.Linear on 3-D inputs."""
        w = self.weight((cin, cout), fan_in=cin)
        b = self.init((0.02 * self.rng.standard_normal(cout)).astype(np.float32), "b")
        return self.node("Add", [self.node("MatMul", [x, w]), b])

    def layer_norm(self, x: str, c: int) -> str:
        g = self.init(np.ones(c, np.float32), "ln_g")
        b = self.init(np.zeros(c, np.float32), "ln_b")
        return self.node("LayerNormalization", [x, g, b], axis=-1, epsilon=1e-12)

    def gelu_erf(self, x: str) -> str:
        half = self.node("Div", [x, self.const([math.sqrt(2.0)], np.float32)])
        erf = self.node("Add", [self.node("Erf", [half]), self.const([1.0], np.float32)])
        return self.node("Mul", [self.node("Mul", [x, erf]), self.const([0.5], np.float32)])

    def build(self, opset: int = 17) -> onnx.ModelProto:
        graph = helper.make_graph(self.nodes, self.name, self.inputs, self.outputs, self.inits)
        model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)],
                                  producer_name="keel-benchmarks")
        model.ir_version = 8
        onnx.checker.check_model(model)
        return model


def mlp() -> onnx.ModelProto:
    b = _Builder("mlp")
    x = b.input("input", ["N", 784])
    for cin, cout in ((784, 512), (512, 256)):
        x = b.node("Relu", [b.gemm(x, cin, cout)])
    b.output(b.gemm(x, 256, 10), "logits", ["N", 10])
    return b.build()


def lenet() -> onnx.ModelProto:
    b = _Builder("lenet")
    x = b.input("input", ["N", 1, 28, 28])
    w1 = b.weight((6, 1, 5, 5), 25)
    x = b.node("Relu", [b.node("Conv", [x, w1, b.init(np.zeros(6, np.float32))],
                               kernel_shape=[5, 5], pads=[2, 2, 2, 2])])
    x = b.node("MaxPool", [x], kernel_shape=[2, 2], strides=[2, 2])
    w2 = b.weight((16, 6, 5, 5), 150)
    x = b.node("Relu", [b.node("Conv", [x, w2, b.init(np.zeros(16, np.float32))],
                               kernel_shape=[5, 5])])
    x = b.node("MaxPool", [x], kernel_shape=[2, 2], strides=[2, 2])
    x = b.node("Flatten", [x], axis=1)
    for cin, cout in ((400, 120), (120, 84)):
        x = b.node("Relu", [b.gemm(x, cin, cout)])
    b.output(b.gemm(x, 84, 10), "logits", ["N", 10])
    return b.build()


def _basic_block(b: _Builder, x: str, cin: int, cout: int, stride: int) -> str:
    y = b.conv_bn(x, cin, cout, 3, stride)
    y = b.conv_bn(y, cout, cout, 3, 1, act=None)
    short = x if stride == 1 and cin == cout else b.conv_bn(x, cin, cout, 1, stride, act=None)
    return b.node("Relu", [b.node("Add", [y, short])])


def _resnet_head(b: _Builder, x: str, cin: int, classes: int) -> None:
    x = b.node("Flatten", [b.node("GlobalAveragePool", [x])], axis=1)
    b.output(b.gemm(x, cin, classes), "logits", ["N", classes])


def resnet20() -> onnx.ModelProto:
    b = _Builder("resnet20")
    x = b.conv_bn(b.input("input", ["N", 3, 32, 32]), 3, 16, 3)
    cin = 16
    for stage, cout in enumerate((16, 32, 64)):
        for i in range(3):
            x = _basic_block(b, x, cin, cout, 2 if stage > 0 and i == 0 else 1)
            cin = cout
    _resnet_head(b, x, 64, 10)
    return b.build()


def resnet18() -> onnx.ModelProto:
    b = _Builder("resnet18")
    x = b.conv_bn(b.input("input", ["N", 3, 224, 224]), 3, 64, 7, 2)
    x = b.node("MaxPool", [x], kernel_shape=[3, 3], strides=[2, 2], pads=[1, 1, 1, 1])
    cin = 64
    for stage, cout in enumerate((64, 128, 256, 512)):
        for i in range(2):
            x = _basic_block(b, x, cin, cout, 2 if stage > 0 and i == 0 else 1)
            cin = cout
    _resnet_head(b, x, 512, 1000)
    return b.build()


def mobilenetv2() -> onnx.ModelProto:
    b = _Builder("mobilenetv2")
    x = b.conv_bn(b.input("input", ["N", 3, 224, 224]), 3, 32, 3, 2, act="Relu6")
    cin = 32
    for t, c, n, s in ((1, 16, 1, 1), (6, 24, 2, 2), (6, 32, 3, 2), (6, 64, 4, 2),
                       (6, 96, 3, 1), (6, 160, 3, 2), (6, 320, 1, 1)):
        for i in range(n):
            stride = s if i == 0 else 1
            hidden = cin * t
            y = x if t == 1 else b.conv_bn(x, cin, hidden, 1, act="Relu6")
            y = b.conv_bn(y, hidden, hidden, 3, stride, group=hidden, act="Relu6")
            y = b.conv_bn(y, hidden, c, 1, act=None)
            x = b.node("Add", [x, y]) if stride == 1 and cin == c else y
            cin = c
    x = b.conv_bn(x, cin, 1280, 1, act="Relu6")
    _resnet_head(b, x, 1280, 1000)
    return b.build()


def bert_mini(seq: int = 128, hidden: int = 256, heads: int = 4, layers: int = 4,
              ffn: int = 1024, vocab: int = 30522) -> onnx.ModelProto:
    b = _Builder("bert_mini")
    ids = b.input("input_ids", ["N", seq], TensorProto.INT64)
    table = b.init((0.02 * b.rng.standard_normal((vocab, hidden))).astype(np.float32), "emb")
    pos = b.init((0.02 * b.rng.standard_normal((seq, hidden))).astype(np.float32), "pos")
    x = b.layer_norm(b.node("Add", [b.node("Gather", [table, ids], axis=0), pos]), hidden)
    shapes = _head_shapes(b, seq, hidden, heads)
    for _ in range(layers):
        x = _encoder_block(b, x, shapes, hidden, ffn)
    b.output(x, "hidden_states", ["N", seq, hidden])
    return b.build()


def _head_shapes(b: _Builder, seq: int, hidden: int, heads: int) -> tuple[str, str, str]:
    """The constants every attention block shares: the split into heads, the merge back
    (``seq`` -1: any sequence length) and the scores' scale."""
    dh = hidden // heads
    return (b.const([0, seq, heads, dh]), b.const([0, seq, hidden]),
            b.const([math.sqrt(dh)], np.float32))


def _encoder_block(b: _Builder, x: str, shapes: tuple[str, str, str], hidden: int,
                   ffn: int) -> str:
    """One post-norm encoder block as PyTorch exports it: unfused attention, LayerNorm,
    Erf GELU."""
    split_shape, merge_shape, scale = shapes

    def heads_of(v: str) -> str:
        return b.node("Transpose", [b.node("Reshape", [v, split_shape])], perm=[0, 2, 1, 3])
    q, k, v = (heads_of(b.linear(x, hidden, hidden)) for _ in range(3))
    kt = b.node("Transpose", [k], perm=[0, 1, 3, 2])
    scores = b.node("Div", [b.node("MatMul", [q, kt]), scale])
    ctx = b.node("MatMul", [b.node("Softmax", [scores], axis=-1), v])
    ctx = b.node("Reshape", [b.node("Transpose", [ctx], perm=[0, 2, 1, 3]), merge_shape])
    x = b.layer_norm(b.node("Add", [x, b.linear(ctx, hidden, hidden)]), hidden)
    h = b.gelu_erf(b.linear(x, hidden, ffn))
    return b.layer_norm(b.node("Add", [x, b.linear(h, ffn, hidden)]), hidden)


def small_block(hidden: int = 256, heads: int = 4, ffn: int = 1024) -> onnx.ModelProto:
    """One post-norm encoder block (attention, LayerNorm, Erf GELU) on hidden states
    of any batch and sequence: the small dynamic shapes of a decode step."""
    b = _Builder("small_block")
    x = b.input("hidden_states", ["N", "S", hidden])
    x = _encoder_block(b, x, _head_shapes(b, -1, hidden, heads), hidden, ffn)
    b.output(x, "out", ["N", "S", hidden])
    return b.build()


# The GPT-2 decode step of the benchmarks (benchmarks/exports.py; needs torch): batch 1
# takes one new token after a cache of DECODE_PAST positions.
DECODE_PAST = 64


def decode_shape() -> Any:
    from benchmarks.exports import GPT2Shape

    return GPT2Shape(layers=4, hidden=256, heads=4, vocab=8192, positions=512)


def gpt2_decode() -> onnx.ModelProto:
    import tempfile
    from pathlib import Path

    from benchmarks.exports import gpt2_decoder

    with tempfile.TemporaryDirectory() as tmp:
        path = gpt2_decoder(Path(tmp) / "gpt2_decode.onnx", decode_shape())
        return onnx.load(str(path))


def decode_feeds(batch: int, past: int = DECODE_PAST, seed: int = 0) -> dict[str, np.ndarray]:
    """The decode step's feeds: one new token per sequence after ``past`` cached ones."""
    from benchmarks.exports import decode_feeds as feeds

    shape = decode_shape()
    rng = np.random.default_rng(seed)
    cache = [rng.standard_normal((batch, shape.heads, past, shape.head_dim)).astype(np.float32)
             for _ in shape.past_names()]
    return feeds(shape, rng.integers(0, shape.vocab, (batch, 1)), cache)


@dataclass(frozen=True)
class ModelSpec:
    name: str
    build: Callable[[], onnx.ModelProto]
    input_name: str
    sample_shape: tuple[int, ...]         # one sample, without the batch dimension
    dtype: str = "float32"
    int_high: int = 0                     # exclusive upper bound for integer inputs
    feeds: Callable[[int], dict[str, np.ndarray]] | None = None   # several inputs

    def make_feeds(self, batch: int) -> dict[str, np.ndarray]:
        """Every input of the model at ``batch``."""
        if self.feeds is not None:
            return self.feeds(batch)
        return {self.input_name: self.make_input(batch)}

    def make_input(self, batch: int, seed: int = 0) -> np.ndarray:
        rng = np.random.default_rng(seed)
        shape = (batch, *self.sample_shape)
        if self.dtype == "int64":
            return rng.integers(0, self.int_high, size=shape, dtype=np.int64)
        return rng.standard_normal(shape).astype(np.float32)


MODELS: dict[str, ModelSpec] = {
    "mlp": ModelSpec("mlp", mlp, "input", (784,)),
    "lenet": ModelSpec("lenet", lenet, "input", (1, 28, 28)),
    "resnet20": ModelSpec("resnet20", resnet20, "input", (3, 32, 32)),
    "resnet18": ModelSpec("resnet18", resnet18, "input", (3, 224, 224)),
    "mobilenetv2": ModelSpec("mobilenetv2", mobilenetv2, "input", (3, 224, 224)),
    "bert_mini": ModelSpec("bert_mini", bert_mini, "input_ids", (128,), "int64", 30522),
    "small_block": ModelSpec("small_block", small_block, "hidden_states", (1, 256)),
    "gpt2_decode": ModelSpec("gpt2_decode", gpt2_decode, "input_ids", (1,), "int64",
                             feeds=decode_feeds),
}
# Models the suite runs unless named: the ones that need no optional package.
DEFAULT_MODELS = tuple(name for name in MODELS if name != "gpt2_decode")


def build(name: str) -> bytes:
    """Serialized ONNX bytes of the named reference model."""
    return MODELS[name].build().SerializeToString()
