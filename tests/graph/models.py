"""Small ONNX models built with onnx.helper for the graph tests, and an ORT runner."""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

F = TensorProto.FLOAT


def rng(seed: int = 0) -> np.random.Generator:
    return np.random.default_rng(seed)


def init(name: str, array: Any) -> onnx.TensorProto:
    return numpy_helper.from_array(np.asarray(array), name)


def model(nodes: Sequence[onnx.NodeProto], inputs: Sequence[onnx.ValueInfoProto],
          outputs: Sequence[onnx.ValueInfoProto], inits: Sequence[onnx.TensorProto] = (),
          opset: int = 17, name: str = "m") -> onnx.ModelProto:
    g = helper.make_graph(list(nodes), name, list(inputs), list(outputs), list(inits))
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", opset)], ir_version=8)
    return m


def vi(name: str, shape: Sequence[Any] | None, elem: int = F) -> onnx.ValueInfoProto:
    return helper.make_tensor_value_info(name, elem, None if shape is None else list(shape))


def run_ort(m: onnx.ModelProto, feeds: Mapping[str, np.ndarray]) -> list[np.ndarray]:
    import onnxruntime as ort

    opts = ort.SessionOptions()
    opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    sess = ort.InferenceSession(m.SerializeToString(), opts, providers=["CPUExecutionProvider"])
    return [np.asarray(o) for o in sess.run(None, dict(feeds))]


def rel_l2(a: np.ndarray, b: np.ndarray) -> float:
    a64, b64 = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    denom = max(float(np.linalg.norm(b64)), 1e-12)
    return float(np.linalg.norm(a64 - b64)) / denom


# ---- models -----------------------------------------------------------------------------
def mlp(r: np.random.Generator, opset: int = 17) -> onnx.ModelProto:
    """MatMul+Add+Relu twice, then Softmax: fuses into GEMMs with relu epilogues."""
    w1, b1 = r.standard_normal((16, 32)).astype(np.float32), r.standard_normal(32).astype(
        np.float32)
    w2, b2 = r.standard_normal((32, 10)).astype(np.float32), r.standard_normal(10).astype(
        np.float32)
    nodes = [
        helper.make_node("MatMul", ["x", "w1"], ["h1"]),
        helper.make_node("Add", ["h1", "b1"], ["h2"]),
        helper.make_node("Relu", ["h2"], ["h3"]),
        helper.make_node("MatMul", ["h3", "w2"], ["h4"]),
        helper.make_node("Add", ["b2", "h4"], ["h5"]),
        helper.make_node("Softmax", ["h5"], ["y"], axis=-1 if opset >= 13 else 1),
    ]
    return model(nodes, [vi("x", ["N", 16])], [vi("y", ["N", 10])],
                 [init("w1", w1), init("b1", b1), init("w2", w2), init("b2", b2)], opset)


def conv_bn_block(r: np.random.Generator, residual: bool = True,
                  opset: int = 17) -> onnx.ModelProto:
    """Conv → BN → Relu → Conv → BN (+ x) → Relu: a ResNet basic block."""
    c = 4

    def bn(prefix: str) -> list[onnx.TensorProto]:
        return [init(f"{prefix}_s", r.uniform(0.5, 1.5, c).astype(np.float32)),
                init(f"{prefix}_b", r.standard_normal(c).astype(np.float32)),
                init(f"{prefix}_m", r.standard_normal(c).astype(np.float32) * 0.1),
                init(f"{prefix}_v", r.uniform(0.5, 1.5, c).astype(np.float32))]

    inits = [init("w1", r.standard_normal((c, c, 3, 3)).astype(np.float32) * 0.3),
             init("w2", r.standard_normal((c, c, 3, 3)).astype(np.float32) * 0.3),
             init("cb", r.standard_normal(c).astype(np.float32)), *bn("bn1"), *bn("bn2")]
    nodes = [
        helper.make_node("Conv", ["x", "w1", "cb"], ["c1"], pads=[1, 1, 1, 1]),
        helper.make_node("BatchNormalization", ["c1", "bn1_s", "bn1_b", "bn1_m", "bn1_v"],
                         ["n1"], epsilon=1e-5),
        helper.make_node("Relu", ["n1"], ["r1"]),
        helper.make_node("Conv", ["r1", "w2"], ["c2"], pads=[1, 1, 1, 1]),
        helper.make_node("BatchNormalization", ["c2", "bn2_s", "bn2_b", "bn2_m", "bn2_v"],
                         ["n2"]),
    ]
    last = "n2"
    if residual:
        nodes.append(helper.make_node("Add", ["n2", "x"], ["s"]))
        last = "s"
    nodes.append(helper.make_node("Relu", [last], ["y"]))
    return model(nodes, [vi("x", ["N", c, 8, 8])], [vi("y", ["N", c, 8, 8])], inits, opset)


def layer_norm_gelu(r: np.random.Generator, tanh: bool = False) -> onnx.ModelProto:
    """The exporters' LayerNorm pattern followed by a GELU pattern (erf or tanh form)."""
    d = 8
    inits = [init("axes", np.array([-1], np.int64)), init("two", np.float32(2.0)),
             init("eps", np.float32(1e-5)), init("g", r.uniform(0.5, 1.5, d).astype(np.float32)),
             init("b", r.standard_normal(d).astype(np.float32)),
             init("half", np.float32(0.5)), init("one", np.float32(1.0)),
             init("sqrt2", np.float32(math.sqrt(2))), init("c1", np.float32(0.044715)),
             init("c2", np.float32(math.sqrt(2 / math.pi))), init("three", np.float32(3.0))]
    nodes = [
        helper.make_node("ReduceMean", ["x"], ["m"], axes=[-1]),
        helper.make_node("Sub", ["x", "m"], ["d"]),
        helper.make_node("Pow", ["d", "two"], ["p"]),
        helper.make_node("ReduceMean", ["p"], ["v"], axes=[-1]),
        helper.make_node("Add", ["v", "eps"], ["ve"]),
        helper.make_node("Sqrt", ["ve"], ["s"]),
        helper.make_node("Div", ["d", "s"], ["n"]),
        helper.make_node("Mul", ["n", "g"], ["ng"]),
        helper.make_node("Add", ["ng", "b"], ["ln"]),
    ]
    if tanh:
        nodes += [
            helper.make_node("Pow", ["ln", "three"], ["x3"]),
            helper.make_node("Mul", ["c1", "x3"], ["cx3"]),
            helper.make_node("Add", ["ln", "cx3"], ["inner"]),
            helper.make_node("Mul", ["inner", "c2"], ["arg"]),
            helper.make_node("Tanh", ["arg"], ["t"]),
            helper.make_node("Add", ["t", "one"], ["t1"]),
            helper.make_node("Mul", ["ln", "half"], ["hx"]),
            helper.make_node("Mul", ["hx", "t1"], ["y"]),
        ]
    else:
        nodes += [
            helper.make_node("Div", ["ln", "sqrt2"], ["xs"]),
            helper.make_node("Erf", ["xs"], ["e"]),
            helper.make_node("Add", ["e", "one"], ["e1"]),
            helper.make_node("Mul", ["ln", "e1"], ["xe"]),
            helper.make_node("Mul", ["xe", "half"], ["y"]),
        ]
    return model(nodes, [vi("x", ["N", 5, d])], [vi("y", ["N", 5, d])], inits, opset=17)


def attention(r: np.random.Generator, with_mask: bool = True) -> onnx.ModelProto:
    """Q·Kᵀ / sqrt(d) + mask → Softmax → ·V with 4-D [B, H, S, D] inputs."""
    nodes = [
        helper.make_node("Transpose", ["k"], ["kt"], perm=[0, 1, 3, 2]),
        helper.make_node("MatMul", ["q", "kt"], ["qk"]),
        helper.make_node("Div", ["qk", "scale"], ["sc"]),
    ]
    inputs = [vi("q", [2, 3, 5, 4]), vi("k", [2, 3, 6, 4]), vi("v", [2, 3, 6, 4])]
    last = "sc"
    if with_mask:
        nodes.append(helper.make_node("Add", ["sc", "mask"], ["scm"]))
        inputs.append(vi("mask", [1, 1, 5, 6]))
        last = "scm"
    nodes += [helper.make_node("Softmax", [last], ["p"], axis=-1),
              helper.make_node("MatMul", ["p", "v"], ["y"])]
    return model(nodes, inputs, [vi("y", [2, 3, 5, 4])], [init("scale", np.float32(2.0))])


def feeds_for(m: onnx.ModelProto, r: np.random.Generator,
              batch: int = 2) -> dict[str, np.ndarray]:
    """Random float32 inputs for every graph input that has no initializer."""
    inits = {t.name for t in m.graph.initializer}
    out = {}
    for v in m.graph.input:
        if v.name in inits:
            continue
        dims = [d.dim_value if d.HasField("dim_value") else batch
                for d in v.type.tensor_type.shape.dim]
        out[v.name] = r.standard_normal(dims).astype(np.float32)
    return out


Builder = Callable[[np.random.Generator], onnx.ModelProto]


def lenet(r: np.random.Generator) -> onnx.ModelProto:
    """Conv/Relu/MaxPool twice, Flatten, three Gemms: a LeNet-style digits CNN."""
    def w(*shape: int) -> np.ndarray:
        return (r.standard_normal(shape) / math.sqrt(np.prod(shape[1:]))).astype(np.float32)

    inits = [init("c1w", w(6, 1, 5, 5)), init("c1b", w(6)), init("c2w", w(16, 6, 5, 5)),
             init("c2b", w(16)), init("f1w", w(120, 256)), init("f1b", w(120)),
             init("f2w", w(84, 120)), init("f2b", w(84)), init("f3w", w(10, 84)),
             init("f3b", w(10))]
    nodes = [
        helper.make_node("Conv", ["x", "c1w", "c1b"], ["c1"]),
        helper.make_node("Relu", ["c1"], ["r1"]),
        helper.make_node("MaxPool", ["r1"], ["p1"], kernel_shape=[2, 2], strides=[2, 2]),
        helper.make_node("Conv", ["p1", "c2w", "c2b"], ["c2"]),
        helper.make_node("Relu", ["c2"], ["r2"]),
        helper.make_node("MaxPool", ["r2"], ["p2"], kernel_shape=[2, 2], strides=[2, 2]),
        helper.make_node("Flatten", ["p2"], ["f"]),
        helper.make_node("Gemm", ["f", "f1w", "f1b"], ["g1"], transB=1),
        helper.make_node("Relu", ["g1"], ["h1"]),
        helper.make_node("Gemm", ["h1", "f2w", "f2b"], ["g2"], transB=1),
        helper.make_node("Relu", ["g2"], ["h2"]),
        helper.make_node("Gemm", ["h2", "f3w", "f3b"], ["y"], transB=1),
    ]
    return model(nodes, [vi("x", ["N", 1, 28, 28])], [vi("y", ["N", 10])], inits)


def mobilenet_block(r: np.random.Generator) -> onnx.ModelProto:
    """Inverted residual: 1x1 expand, 3x3 depthwise (group=C), 1x1 project, each with BN."""
    c, e = 8, 16

    def bn(prefix: str, n: int) -> list[onnx.TensorProto]:
        return [init(f"{prefix}_s", r.uniform(0.5, 1.5, n).astype(np.float32)),
                init(f"{prefix}_b", r.standard_normal(n).astype(np.float32) * 0.1),
                init(f"{prefix}_m", r.standard_normal(n).astype(np.float32) * 0.1),
                init(f"{prefix}_v", r.uniform(0.5, 1.5, n).astype(np.float32))]

    inits = [init("we", r.standard_normal((e, c, 1, 1)).astype(np.float32) * 0.3),
             init("wd", r.standard_normal((e, 1, 3, 3)).astype(np.float32) * 0.3),
             init("wp", r.standard_normal((c, e, 1, 1)).astype(np.float32) * 0.3),
             init("lo", np.float32(0.0)), init("hi", np.float32(6.0)),
             *bn("b1", e), *bn("b2", e), *bn("b3", c)]

    def bn_node(x: str, p: str, y: str) -> onnx.NodeProto:
        return helper.make_node("BatchNormalization", [x, f"{p}_s", f"{p}_b", f"{p}_m",
                                                       f"{p}_v"], [y])

    nodes = [
        helper.make_node("Conv", ["x", "we"], ["e1"]), bn_node("e1", "b1", "e2"),
        helper.make_node("Clip", ["e2", "lo", "hi"], ["e3"]),
        helper.make_node("Conv", ["e3", "wd"], ["d1"], group=e, pads=[1, 1, 1, 1]),
        bn_node("d1", "b2", "d2"), helper.make_node("Clip", ["d2", "lo", "hi"], ["d3"]),
        helper.make_node("Conv", ["d3", "wp"], ["p1"]), bn_node("p1", "b3", "p2"),
        helper.make_node("Add", ["x", "p2"], ["s"]),
        helper.make_node("GlobalAveragePool", ["s"], ["y"]),
    ]
    return model(nodes, [vi("x", ["N", c, 7, 7])], [vi("y", ["N", c, 1, 1])], inits)


def transformer(r: np.random.Generator, layers: int = 2) -> onnx.ModelProto:
    """Token + position embeddings, then pre-LN encoder layers written as exporters spell them:
    LayerNorm and GELU as elementwise patterns, attention as Reshape/Transpose/MatMul/Softmax
    with a causal additive mask."""
    vocab, seq, d, heads, ff = 50, 6, 16, 2, 32
    dh = d // heads
    b = _Builder(r)
    b.inits += [init("emb", r.standard_normal((vocab, d)).astype(np.float32)),
                init("pos", r.standard_normal((seq, d)).astype(np.float32) * 0.1),
                init("mask", np.triu(np.full((1, 1, seq, seq), -1e9, np.float32), 1)),
                init("heads_shape", np.array([0, 0, heads, dh], np.int64)),
                init("merge_shape", np.array([0, 0, d], np.int64)),
                init("scale", np.float32(math.sqrt(dh))), init("axes", np.array([-1], np.int64)),
                init("two", np.float32(2.0)), init("eps", np.float32(1e-5)),
                init("half", np.float32(0.5)), init("one", np.float32(1.0)),
                init("sqrt2", np.float32(math.sqrt(2)))]
    b.node("Gather", ["emb", "ids"], ["tok"])
    b.node("Add", ["tok", "pos"], ["x0"])
    x = "x0"
    for i in range(layers):
        x = _encoder_layer(b, x, f"l{i}", d, ff)
    y = b.layer_norm(x, "final", d)
    b.node("Identity", [y], ["y"])
    return model(b.nodes, [vi("ids", ["N", seq], TensorProto.INT64)], [vi("y", ["N", seq, d])],
                 b.inits, opset=17)


class _Builder:
    def __init__(self, r: np.random.Generator) -> None:
        self.r = r
        self.nodes: list[onnx.NodeProto] = []
        self.inits: list[onnx.TensorProto] = []

    def node(self, op: str, ins: list[str], outs: list[str], **attrs: Any) -> str:
        self.nodes.append(helper.make_node(op, ins, outs, **attrs))
        return outs[0]

    def linear(self, x: str, name: str, n_in: int, n_out: int) -> str:
        self.inits += [init(f"{name}_w", (self.r.standard_normal((n_in, n_out))
                                          / math.sqrt(n_in)).astype(np.float32)),
                       init(f"{name}_b", self.r.standard_normal(n_out).astype(np.float32) * .1)]
        self.node("MatMul", [x, f"{name}_w"], [f"{name}_mm"])
        return self.node("Add", [f"{name}_mm", f"{name}_b"], [f"{name}_out"])

    def layer_norm(self, x: str, p: str, d: int) -> str:
        self.inits += [init(f"{p}_g", self.r.uniform(0.5, 1.5, d).astype(np.float32)),
                       init(f"{p}_beta", self.r.standard_normal(d).astype(np.float32) * 0.1)]
        self.node("ReduceMean", [x], [f"{p}_mean"], axes=[-1])
        self.node("Sub", [x, f"{p}_mean"], [f"{p}_d"])
        self.node("Pow", [f"{p}_d", "two"], [f"{p}_sq"])
        self.node("ReduceMean", [f"{p}_sq"], [f"{p}_var"], axes=[-1])
        self.node("Add", [f"{p}_var", "eps"], [f"{p}_ve"])
        self.node("Sqrt", [f"{p}_ve"], [f"{p}_std"])
        self.node("Div", [f"{p}_d", f"{p}_std"], [f"{p}_n"])
        self.node("Mul", [f"{p}_n", f"{p}_g"], [f"{p}_ng"])
        return self.node("Add", [f"{p}_ng", f"{p}_beta"], [f"{p}_ln"])

    def gelu(self, x: str, p: str) -> str:
        self.node("Div", [x, "sqrt2"], [f"{p}_xs"])
        self.node("Erf", [f"{p}_xs"], [f"{p}_erf"])
        self.node("Add", [f"{p}_erf", "one"], [f"{p}_e1"])
        self.node("Mul", [x, f"{p}_e1"], [f"{p}_xe"])
        return self.node("Mul", [f"{p}_xe", "half"], [f"{p}_gelu"])


def _encoder_layer(b: _Builder, x: str, p: str, d: int, ff: int) -> str:
    h = b.layer_norm(x, f"{p}_ln1", d)
    q, k, v = (b.linear(h, f"{p}_{n}", d, d) for n in "qkv")
    for n, src in (("q", q), ("k", k), ("v", v)):
        b.node("Reshape", [src, "heads_shape"], [f"{p}_{n}_h"])
    b.node("Transpose", [f"{p}_q_h"], [f"{p}_qt"], perm=[0, 2, 1, 3])
    b.node("Transpose", [f"{p}_k_h"], [f"{p}_kt"], perm=[0, 2, 3, 1])
    b.node("Transpose", [f"{p}_v_h"], [f"{p}_vt"], perm=[0, 2, 1, 3])
    b.node("MatMul", [f"{p}_qt", f"{p}_kt"], [f"{p}_s"])
    b.node("Div", [f"{p}_s", "scale"], [f"{p}_ss"])
    b.node("Add", [f"{p}_ss", "mask"], [f"{p}_sm"])
    b.node("Softmax", [f"{p}_sm"], [f"{p}_p"], axis=-1)
    b.node("MatMul", [f"{p}_p", f"{p}_vt"], [f"{p}_o"])
    b.node("Transpose", [f"{p}_o"], [f"{p}_ot"], perm=[0, 2, 1, 3])
    b.node("Reshape", [f"{p}_ot", "merge_shape"], [f"{p}_om"])
    a = b.linear(f"{p}_om", f"{p}_proj", d, d)
    b.node("Add", [x, a], [f"{p}_r1"])
    h2 = b.layer_norm(f"{p}_r1", f"{p}_ln2", d)
    f1 = b.linear(h2, f"{p}_ff1", d, ff)
    g = b.gelu(f1, f"{p}_act")
    f2 = b.linear(g, f"{p}_ff2", ff, d)
    return b.node("Add", [f"{p}_r1", f2], [f"{p}_r2"])


def token_feeds(batch: int, r: np.random.Generator) -> dict[str, np.ndarray]:
    return {"ids": r.integers(0, 50, size=(batch, 6)).astype(np.int64)}
