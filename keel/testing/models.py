"""Small real-world-shaped ONNX models built with ``onnx.helper``, and inputs for them.

Each builder returns an ``onnx.ModelProto`` with a symbolic batch dimension
(``"batch"``) and seeded random weights scaled so activations stay near unit
size. Sizes are parameters: tests use small ones, benchmarks larger ones.

* :func:`mlp` — Gemm, MatMul + Add, Relu, Softmax.
* :func:`lenet` — Conv, Relu, MaxPool, AveragePool, Flatten, Gemm.
* :func:`resnet_block` — Conv + BatchNormalization + Relu twice, a residual Add,
  GlobalAveragePool and a classifier.
* :func:`mobilenet_block` — an inverted residual: 1x1 expand, 3x3 depthwise
  (``group`` = channels), 1x1 project, ReLU6 (Clip) or HardSwish.
* :func:`transformer_encoder` — token embeddings (Gather) plus positions,
  multi-head self-attention (Reshape/Transpose/MatMul/Softmax), LayerNorm and
  GELU written out as PyTorch exports them, in ``layers`` post-norm blocks.

:func:`make_inputs` draws inputs for any of them (token ids below the
vocabulary size recorded in the model's metadata).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

__all__ = ["BUILDERS", "OPSET", "lenet", "make_inputs", "mlp", "mobilenet_block",
           "resnet_block", "resnet_stages", "transformer_encoder"]

OPSET = 17
_F32 = 1       # onnx.TensorProto.FLOAT
_I64 = 7       # onnx.TensorProto.INT64


class _Builder:
    """Collects nodes and initializers; names values uniquely."""

    def __init__(self, seed: int) -> None:
        self.rng = np.random.default_rng(seed)
        self.nodes: list[Any] = []
        self.inits: list[Any] = []
        self._n = 0

    def name(self, base: str) -> str:
        self._n += 1
        return f"{base}_{self._n}"

    def const(self, base: str, value: np.ndarray) -> str:
        from onnx import numpy_helper

        name = self.name(base)
        self.inits.append(numpy_helper.from_array(np.ascontiguousarray(value), name))
        return name

    def weight(self, base: str, shape: Sequence[int], fan_in: int) -> str:
        w = self.rng.standard_normal(tuple(shape)) * math.sqrt(2.0 / max(fan_in, 1))
        return self.const(base, w.astype(np.float32))

    def bias(self, base: str, n: int) -> str:
        return self.const(base, (0.1 * self.rng.standard_normal(n)).astype(np.float32))

    def op(self, op_type: str, inputs: Sequence[str], n_out: int = 1, **attrs: Any) -> Any:
        from onnx import helper

        outs = [self.name(op_type.lower()) for _ in range(n_out)]
        self.nodes.append(helper.make_node(op_type, list(inputs), outs,
                                           name=self.name(f"{op_type}_node"), **attrs))
        return outs[0] if n_out == 1 else outs

    def model(self, name: str, inputs: list[Any], outputs: list[Any],
              metadata: dict[str, str] | None = None) -> Any:
        from onnx import helper

        graph = helper.make_graph(self.nodes, name, inputs, outputs, self.inits)
        model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET)],
                                  producer_name="keel.testing")
        model.ir_version = 8
        for key, value in (metadata or {}).items():
            helper.set_model_props(model, {**_props(model), key: value})
        return model


def _props(model: Any) -> dict[str, str]:
    return {p.key: p.value for p in model.metadata_props}


def _value(name: str, elem: int, shape: Sequence[int | str]) -> Any:
    from onnx import helper

    return helper.make_tensor_value_info(name, elem, list(shape))


# ---- MLP -------------------------------------------------------------------
def mlp(in_features: int = 64, hidden: Sequence[int] = (128, 64), classes: int = 10,
        seed: int = 0) -> Any:
    """Gemm (transB) + Relu, then MatMul + Add + Relu layers, then a Softmax head."""
    b = _Builder(seed)
    x, width = "x", in_features
    for i, h in enumerate(hidden):
        if i == 0:
            w = b.weight("w", (h, width), width)
            x = b.op("Gemm", [x, w, b.bias("b", h)], transB=1)
        else:
            w = b.weight("w", (width, h), width)
            x = b.op("Add", [b.op("MatMul", [x, w]), b.bias("b", h)])
        x = b.op("Relu", [x])
        width = h
    logits = b.op("Add", [b.op("MatMul", [x, b.weight("w", (width, classes), width)]),
                          b.bias("b", classes)])
    b.nodes.append(_node("Softmax", [logits], ["probs"], axis=-1))
    return b.model("mlp", [_value("x", _F32, ("batch", in_features))],
                   [_value("probs", _F32, ("batch", classes))])


def _node(op_type: str, inputs: list[str], outputs: list[str], **attrs: Any) -> Any:
    from onnx import helper

    return helper.make_node(op_type, inputs, outputs, name=f"{outputs[0]}_node", **attrs)


# ---- LeNet -----------------------------------------------------------------
def lenet(channels: int = 1, size: int = 28, classes: int = 10, seed: int = 0) -> Any:
    """Conv 5x5 → Relu → MaxPool → Conv 5x5 → Relu → AveragePool → 3 Gemm layers."""
    b = _Builder(seed)
    x = b.op("Conv", ["x", b.weight("c", (6, channels, 5, 5), channels * 25), b.bias("b", 6)],
             pads=[2, 2, 2, 2])
    x = b.op("MaxPool", [b.op("Relu", [x])], kernel_shape=[2, 2], strides=[2, 2])
    x = b.op("Conv", [x, b.weight("c", (16, 6, 5, 5), 150), b.bias("b", 16)])
    x = b.op("AveragePool", [b.op("Relu", [x])], kernel_shape=[2, 2], strides=[2, 2])
    side = ((size // 2) - 4) // 2
    width = 16 * side * side
    x = b.op("Flatten", [x], axis=1)
    for n in (120, 84):
        x = b.op("Relu", [b.op("Gemm", [x, b.weight("w", (n, width), width), b.bias("b", n)],
                               transB=1)])
        width = n
    b.nodes.append(_node("Gemm", [x, b.weight("w", (width, classes), width),
                                  b.bias("b", classes)], ["logits"]))
    return b.model("lenet", [_value("x", _F32, ("batch", channels, size, size))],
                   [_value("logits", _F32, ("batch", classes))])


# ---- ResNet-style block ------------------------------------------------------
def _batch_norm(b: _Builder, x: str, c: int) -> str:
    scale = (1.0 + 0.1 * b.rng.standard_normal(c)).astype(np.float32)
    mean = (0.1 * b.rng.standard_normal(c)).astype(np.float32)
    var = (0.5 + b.rng.random(c)).astype(np.float32)
    return str(b.op("BatchNormalization", [x, b.const("scale", scale), b.bias("shift", c),
                                           b.const("mean", mean), b.const("var", var)],
                    epsilon=1e-5))


def _conv(b: _Builder, x: str, c_in: int, c_out: int, k: int, group: int = 1,
          bias: bool = False) -> str:
    pad = k // 2
    w = b.weight("conv", (c_out, c_in // group, k, k), (c_in // group) * k * k)
    inputs = [x, w] + ([b.bias("b", c_out)] if bias else [])
    return str(b.op("Conv", inputs, pads=[pad] * 4, group=group, kernel_shape=[k, k]))


def resnet_block(channels: int = 16, size: int = 16, classes: int = 10, seed: int = 0) -> Any:
    """Stem conv, a basic residual block (Conv-BN-Relu-Conv-BN + identity), pool, Gemm."""
    b = _Builder(seed)
    stem = b.op("Relu", [_batch_norm(b, _conv(b, "x", 3, channels, 3), channels)])
    y = b.op("Relu", [_batch_norm(b, _conv(b, stem, channels, channels, 3), channels)])
    y = _batch_norm(b, _conv(b, y, channels, channels, 3), channels)
    y = b.op("Relu", [b.op("Add", [y, stem])])
    pooled = b.op("Flatten", [b.op("GlobalAveragePool", [y])], axis=1)
    b.nodes.append(_node("Gemm", [pooled, b.weight("w", (classes, channels), channels),
                                  b.bias("b", classes)], ["logits"], transB=1))
    return b.model("resnet_block", [_value("x", _F32, ("batch", 3, size, size))],
                   [_value("logits", _F32, ("batch", classes))])


def _conv_bn(b: _Builder, x: str, c_in: int, c_out: int, k: int, stride: int = 1,
             relu: bool = True) -> str:
    w = b.weight("conv", (c_out, c_in, k, k), c_in * k * k)
    y = _batch_norm(b, str(b.op("Conv", [x, w], pads=[k // 2] * 4, strides=[stride] * 2,
                                kernel_shape=[k, k])), c_out)
    return str(b.op("Relu", [y])) if relu else y


def resnet_stages(channels: int = 16, size: int = 16, classes: int = 10, seed: int = 0) -> Any:
    """A ResNet-18 in small: stem conv, a 3x3 stride-2 max pool, a basic block, a
    downsampling block (3x3 stride 2 and a 1x1 stride-2 shortcut to twice the channels),
    pool, Gemm."""
    b = _Builder(seed)
    x = str(b.op("MaxPool", [_conv_bn(b, "x", 3, channels, 3)], kernel_shape=[3, 3],
                 strides=[2, 2], pads=[1, 1, 1, 1]))
    for c_in, c_out, stride in ((channels, channels, 1), (channels, 2 * channels, 2)):
        y = _conv_bn(b, _conv_bn(b, x, c_in, c_out, 3, stride), c_out, c_out, 3, relu=False)
        short = x if stride == 1 else _conv_bn(b, x, c_in, c_out, 1, stride, relu=False)
        x = str(b.op("Relu", [b.op("Add", [y, short])]))
    pooled = b.op("Flatten", [b.op("GlobalAveragePool", [x])], axis=1)
    b.nodes.append(_node("Gemm", [pooled, b.weight("w", (classes, 2 * channels), 2 * channels),
                                  b.bias("b", classes)], ["logits"], transB=1))
    return b.model("resnet_stages", [_value("x", _F32, ("batch", 3, size, size))],
                   [_value("logits", _F32, ("batch", classes))])


# ---- MobileNet-style block ---------------------------------------------------
def mobilenet_block(channels: int = 16, expansion: int = 4, size: int = 16, classes: int = 10,
                    activation: str = "relu6", seed: int = 0, blocks: int = 1) -> Any:
    """Inverted residual: 1x1 expand, 3x3 depthwise, 1x1 project, residual Add (``blocks``
    of them in a row); pool, Gemm."""
    if activation not in ("relu6", "hardswish"):
        raise ValueError(f"activation must be relu6 or hardswish, got {activation!r}")
    b = _Builder(seed)

    def act(v: str) -> str:
        if activation == "hardswish":
            return str(b.op("HardSwish", [v]))
        return str(b.op("Clip", [v, b.const("lo", np.array(0, np.float32)),
                                 b.const("hi", np.array(6, np.float32))]))

    wide = channels * expansion
    y = act(_batch_norm(b, _conv(b, "x", 3, channels, 3), channels))
    for _ in range(blocks):
        stem = y
        y = act(_batch_norm(b, _conv(b, stem, channels, wide, 1), wide))
        y = act(_batch_norm(b, _conv(b, y, wide, wide, 3, group=wide), wide))
        y = _batch_norm(b, _conv(b, y, wide, channels, 1), channels)
        y = b.op("Add", [y, stem])
    pooled = b.op("Flatten", [b.op("GlobalAveragePool", [y])], axis=1)
    b.nodes.append(_node("Gemm", [pooled, b.weight("w", (classes, channels), channels),
                                  b.bias("b", classes)], ["logits"], transB=1))
    return b.model("mobilenet_block", [_value("x", _F32, ("batch", 3, size, size))],
                   [_value("logits", _F32, ("batch", classes))])


# ---- transformer encoder -----------------------------------------------------
def _layer_norm(b: _Builder, x: str, d: int) -> str:
    """LayerNorm as PyTorch exports it below opset 17's fused op: mean, var, normalize."""
    mean = b.op("ReduceMean", [x], axes=[-1], keepdims=1)
    centered = b.op("Sub", [x, mean])
    var = b.op("ReduceMean", [b.op("Pow", [centered, b.const("two", np.array(2, np.float32))])],
               axes=[-1], keepdims=1)
    std = b.op("Sqrt", [b.op("Add", [var, b.const("eps", np.array(1e-5, np.float32))])])
    normed = b.op("Div", [centered, std])
    gamma = (1.0 + 0.1 * b.rng.standard_normal(d)).astype(np.float32)
    return str(b.op("Add", [b.op("Mul", [normed, b.const("gamma", gamma)]), b.bias("beta", d)]))


def _gelu(b: _Builder, x: str) -> str:
    """x * 0.5 * (1 + erf(x / sqrt(2))), the exact GELU PyTorch exports."""
    erf = b.op("Erf", [b.op("Div", [x, b.const("sqrt2", np.array(math.sqrt(2), np.float32))])])
    one_plus = b.op("Add", [erf, b.const("one", np.array(1, np.float32))])
    return str(b.op("Mul", [b.op("Mul", [x, one_plus]),
                            b.const("half", np.array(0.5, np.float32))]))


def _linear(b: _Builder, x: str, d_in: int, d_out: int) -> str:
    return str(b.op("Add", [b.op("MatMul", [x, b.weight("w", (d_in, d_out), d_in)]),
                            b.bias("b", d_out)]))


def _attention(b: _Builder, x: str, d: int, heads: int) -> str:
    dh = d // heads
    split = b.const("split_shape", np.array([0, 0, heads, dh], np.int64))

    def project(perm: list[int]) -> str:
        return str(b.op("Transpose", [b.op("Reshape", [_linear(b, x, d, d), split])], perm=perm))

    q, k, v = project([0, 2, 1, 3]), project([0, 2, 3, 1]), project([0, 2, 1, 3])
    scores = b.op("Div", [b.op("MatMul", [q, k]), b.const("scale", np.array(math.sqrt(dh),
                                                                             np.float32))])
    ctx = b.op("MatMul", [b.op("Softmax", [scores], axis=-1), v])
    merged = b.op("Reshape", [b.op("Transpose", [ctx], perm=[0, 2, 1, 3]),
                              b.const("merge_shape", np.array([0, 0, d], np.int64))])
    return _linear(b, merged, d, d)


def transformer_encoder(vocab: int = 100, seq: int = 16, d_model: int = 32, heads: int = 4,
                        ff: int = 64, layers: int = 2, classes: int = 10, seed: int = 0) -> Any:
    """Token + position embeddings, ``layers`` post-norm encoder blocks, a pooled classifier."""
    if d_model % heads:
        raise ValueError(f"d_model {d_model} must be a multiple of heads {heads}")
    b = _Builder(seed)
    table = (b.rng.standard_normal((vocab, d_model)) * 0.5).astype(np.float32)
    positions = (b.rng.standard_normal((seq, d_model)) * 0.1).astype(np.float32)
    x = b.op("Add", [b.op("Gather", [b.const("embedding", table), "tokens"], axis=0),
                     b.const("positions", positions)])
    for _ in range(layers):
        x = _layer_norm(b, b.op("Add", [x, _attention(b, x, d_model, heads)]), d_model)
        hidden = _linear(b, _gelu(b, _linear(b, x, d_model, ff)), ff, d_model)
        x = _layer_norm(b, b.op("Add", [x, hidden]), d_model)
    b.nodes.append(_node("Identity", [x], ["hidden"]))
    pooled = b.op("ReduceMean", ["hidden"], axes=[1], keepdims=0)
    b.nodes.append(_node("Add", [b.op("MatMul", [pooled, b.weight("w", (d_model, classes),
                                                                    d_model)]),
                                 b.bias("b", classes)], ["logits"]))
    return b.model("transformer_encoder", [_value("tokens", _I64, ("batch", seq))],
                   [_value("hidden", _F32, ("batch", seq, d_model)),
                    _value("logits", _F32, ("batch", classes))],
                   metadata={"keel.vocab_size": str(vocab)})


BUILDERS: dict[str, Callable[..., Any]] = {
    "mlp": mlp,
    "lenet": lenet,
    "resnet_block": resnet_block,
    "mobilenet_block": mobilenet_block,
    "transformer_encoder": transformer_encoder,
}


def make_inputs(model: Any, batch: int, seed: int = 0) -> dict[str, np.ndarray]:
    """Random inputs for ``model`` with the symbolic batch dimension set to ``batch``."""
    rng = np.random.default_rng(seed)
    vocab = int(_props(model).get("keel.vocab_size", "10"))
    inits = {i.name for i in model.graph.initializer}
    feeds: dict[str, np.ndarray] = {}
    for vi in model.graph.input:
        if vi.name in inits:
            continue
        tt = vi.type.tensor_type
        shape = tuple(d.dim_value if d.HasField("dim_value") else batch for d in tt.shape.dim)
        if tt.elem_type == _I64:
            feeds[vi.name] = rng.integers(0, vocab, size=shape, dtype=np.int64)
        else:
            feeds[vi.name] = rng.standard_normal(shape).astype(np.float32)
    return feeds
