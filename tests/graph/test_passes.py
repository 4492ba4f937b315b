"""Optimization passes: each one's pattern, its limits, and output equivalence."""

from __future__ import annotations

import copy
import importlib
import math
from collections.abc import Callable
from typing import Any

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

from keel.errors import InvalidArgumentError
from keel.graph import passes as P
from keel.graph.importers.onnx import import_onnx
from keel.graph.ir import Graph
from keel.graph.passes import LEVELS, optimize, optimize_with_report
from keel.ops.registry import Op
from tests.graph import models as M
from tests.graph.interp import run_graph
from tests.graph.models import init, model, rel_l2, rng, vi

PASSES: dict[str, Callable[[Graph], Graph]] = {
    "fold_constants": P.fold_constants, "eliminate_dead": P.eliminate_dead,
    "remove_identity": P.remove_identity, "fold_shapes": P.fold_shapes,
    "fuse_conv_bn": P.fuse_conv_bn, "fuse_activation": P.fuse_activation,
    "fuse_matmul_add": P.fuse_matmul_add, "fuse_layer_norm": P.fuse_layer_norm,
    "fuse_gelu": P.fuse_gelu, "fuse_attention": P.fuse_attention,
    "fuse_residual": P.fuse_residual, "cancel_transposes": P.cancel_transposes,
    "fuse_skip_layer_norm": P.fuse_skip_layer_norm, "order_shared_reads": P.order_shared_reads,
}


def ops(g: Graph) -> list[Op]:
    return [n.op for n in g.nodes]


def snapshot(g: Graph) -> Any:
    return ([(n.name, n.op, list(n.inputs), list(n.outputs), dict(n.attrs)) for n in g.nodes],
            list(g.inputs), list(g.outputs), sorted(g.initializers))


def feeds_of(g: Graph, r: np.random.Generator, batch: int = 2) -> dict[str, np.ndarray]:
    out = {}
    for v in g.inputs:
        if v.name in g.initializers:
            continue
        shape = [d if isinstance(d, int) else batch for d in v.type.shape or ()]
        if v.type.dtype.is_int:
            out[v.name] = r.integers(0, 50, size=shape).astype(v.type.dtype.numpy)
        else:
            out[v.name] = r.standard_normal(shape).astype(v.type.dtype.numpy)
    return out


def assert_same_outputs(before: Graph, after: Graph, feeds: dict[str, np.ndarray],
                        tol: float = 1e-5) -> None:
    want, got = run_graph(before, feeds), run_graph(after, feeds)
    assert after.output_names == before.output_names
    for name in before.output_names:
        assert got[name].shape == want[name].shape and got[name].dtype == want[name].dtype
        assert rel_l2(got[name], want[name]) < tol, name


def apply(fn: Callable[[Graph], Graph], m: onnx.ModelProto,
          feeds: dict[str, np.ndarray] | None = None) -> tuple[Graph, Graph]:
    """Run one pass; check it left its input alone and kept the outputs' values."""
    g = import_onnx(m)
    before = snapshot(g)
    out = fn(g)
    assert snapshot(g) == before, "the pass changed its input graph"
    out.verify()
    assert_same_outputs(g, out, feeds if feeds is not None else feeds_of(g, rng(5)))
    return g, out


ALL_MODELS: dict[str, Callable[[np.random.Generator], onnx.ModelProto]] = {
    "mlp": M.mlp, "lenet": M.lenet, "resnet_block": M.conv_bn_block,
    "mobilenet_block": M.mobilenet_block, "transformer": M.transformer,
    "ln_gelu": M.layer_norm_gelu, "attention": M.attention,
}


@pytest.mark.parametrize("pass_name", sorted(PASSES))
@pytest.mark.parametrize("model_name", sorted(ALL_MODELS))
def test_every_pass_keeps_outputs_and_leaves_its_input_alone(pass_name: str,
                                                            model_name: str) -> None:
    apply(PASSES[pass_name], ALL_MODELS[model_name](rng(3)))


# ---- basic passes ---------------------------------------------------------------------------
def test_fold_constants_runs_nodes_of_constants_once() -> None:
    w = rng(0).standard_normal((4, 3)).astype(np.float32)
    nodes = [helper.make_node("Transpose", ["w"], ["wt"]),
             helper.make_node("Add", ["one", "one"], ["two"]),
             helper.make_node("MatMul", ["x", "wt"], ["h"]),
             helper.make_node("Mul", ["h", "two"], ["y"])]
    m = model(nodes, [vi("x", [2, 3])], [vi("y", [2, 4])],
              [init("w", w), init("one", np.float32(1.0))])
    _, out = apply(P.fold_constants, m)
    assert ops(out) == [Op.MATMUL, Op.MUL]
    np.testing.assert_array_equal(out.initializers["wt"], w.T)
    assert out.initializers["two"].dtype == np.float32


def test_fold_constants_leaves_overridable_initializers() -> None:
    nodes = [helper.make_node("Neg", ["w"], ["nw"]), helper.make_node("Add", ["x", "nw"], ["y"])]
    m = model(nodes, [vi("x", [3]), vi("w", [3])], [vi("y", [3])],
              [init("w", np.ones(3, np.float32))])
    _, out = apply(P.fold_constants, m)
    assert ops(out) == [Op.NEG, Op.ADD]


def test_fold_constants_respects_the_size_limit(monkeypatch: pytest.MonkeyPatch) -> None:
    # The package re-exports the function under the module's name; patch the module.
    fc = importlib.import_module("keel.graph.passes.fold_constants")
    nodes = [helper.make_node("Tile", ["w", "reps"], ["big"]),
             helper.make_node("Add", ["x", "big"], ["y"])]
    m = model(nodes, [vi("x", [64, 64])], [vi("y", [64, 64])],
              [init("w", np.ones((1, 1), np.float32)), init("reps", np.array([64, 64], np.int64))])
    monkeypatch.setattr(fc, "FOLD_LIMIT_BYTES", 1024)
    _, out = apply(P.fold_constants, m)
    assert Op.TILE in ops(out)


def test_fold_constants_of_a_graph_output_keeps_its_name() -> None:
    nodes = [helper.make_node("Neg", ["c"], ["y"]), helper.make_node("Relu", ["x"], ["z"])]
    m = model(nodes, [vi("x", [2])], [vi("y", [2]), vi("z", [2])],
              [init("c", np.ones(2, np.float32))])
    _, out = apply(P.fold_constants, m)
    assert ops(out) == [Op.RELU] and "y" in out.initializers


def test_eliminate_dead_drops_unused_nodes_and_initializers_but_not_inputs() -> None:
    nodes = [helper.make_node("Relu", ["x"], ["y"]),
             helper.make_node("Add", ["x", "w"], ["dead"]),
             helper.make_node("Neg", ["dead"], ["dead2"])]
    m = model(nodes, [vi("x", [2]), vi("unused", [2])], [vi("y", [2])],
              [init("w", np.ones(2, np.float32))])
    _, out = apply(P.eliminate_dead, m, {"x": np.ones(2, np.float32),
                                          "unused": np.ones(2, np.float32)})
    assert ops(out) == [Op.RELU] and not out.initializers
    assert out.input_names == ["x", "unused"]


def test_eliminate_dead_drops_unread_optional_outputs() -> None:
    nodes = [helper.make_node("LayerNormalization", ["x", "g"], ["y", "mean", "inv"])]
    m = model(nodes, [vi("x", [2, 4])], [vi("y", [2, 4])], [init("g", np.ones(4, np.float32))])
    _, out = apply(P.eliminate_dead, m)
    assert out.nodes[0].outputs == ["y"]


def test_remove_identity_and_inference_dropout() -> None:
    nodes = [helper.make_node("Identity", ["x"], ["a"]),
             helper.make_node("Relu", ["a"], ["b"]),
             helper.make_node("Dropout", ["b"], ["c"]),
             helper.make_node("Cast", ["c"], ["d"], to=TensorProto.FLOAT),
             helper.make_node("Identity", ["d"], ["y"])]
    m = model(nodes, [vi("x", [3])], [vi("y", [3])])
    _, out = apply(P.remove_identity, m)
    assert ops(out) == [Op.RELU]
    assert out.nodes[0].inputs == ["x"] and out.nodes[0].outputs == ["y"]


def test_identity_from_an_input_to_an_output_stays() -> None:
    nodes = [helper.make_node("Identity", ["x"], ["y"]), helper.make_node("Neg", ["x"], ["z"])]
    m = model(nodes, [vi("x", [3])], [vi("y", [3]), vi("z", [3])])
    _, out = apply(P.remove_identity, m)
    assert ops(out) == [Op.IDENTITY, Op.NEG]


def test_identity_between_two_graph_outputs_stays() -> None:
    nodes = [helper.make_node("Relu", ["x"], ["a"]), helper.make_node("Identity", ["a"], ["y"])]
    m = model(nodes, [vi("x", [3])], [vi("a", [3]), vi("y", [3])])
    _, out = apply(P.remove_identity, m)
    assert ops(out) == [Op.RELU, Op.IDENTITY]


def _flatten_by_shape(batch: Any) -> onnx.ModelProto:
    nodes = [helper.make_node("Shape", ["x"], ["s"]),
             helper.make_node("Gather", ["s", "one"], ["c"], axis=0),
             helper.make_node("Unsqueeze", ["c", "axes0"], ["c1"]),
             helper.make_node("Concat", ["minus1", "c1"], ["shape"], axis=0),
             helper.make_node("Reshape", ["x", "shape"], ["y"])]
    return model(nodes, [vi("x", [batch, 3, 4])], [vi("y", None)],
                 [init("one", np.array(1, np.int64)), init("axes0", np.array([0], np.int64)),
                  init("minus1", np.array([-1], np.int64))])


@pytest.mark.parametrize("batch", [5, "N"])
def test_fold_shapes_collapses_shape_arithmetic(batch: Any) -> None:
    feeds = {"x": rng(0).standard_normal((5, 3, 4)).astype(np.float32)}
    _, out = apply(P.fold_shapes, _flatten_by_shape(batch), feeds)
    # With a static shape, or a symbolic batch but a static picked dim, all of it folds.
    assert Op.GATHER not in ops(out) and Op.CONCAT not in ops(out)
    np.testing.assert_array_equal(out.initializers["shape"], [-1, 3])
    assert P.eliminate_dead(out).nodes[-1].op is Op.RESHAPE
    assert ops(P.eliminate_dead(out)) == [Op.RESHAPE]


def test_fold_shapes_keeps_symbolic_dims_symbolic() -> None:
    nodes = [helper.make_node("Shape", ["x"], ["s"]),
             helper.make_node("Gather", ["s", "zero"], ["n"], axis=0),
             helper.make_node("Cast", ["n"], ["y"], to=TensorProto.FLOAT)]
    m = model(nodes, [vi("x", ["N", 3])], [vi("y", None)],
              [init("zero", np.array(0, np.int64))])
    _, out = apply(P.fold_shapes, m, {"x": np.ones((7, 3), np.float32)})
    assert ops(out) == [Op.SHAPE, Op.GATHER, Op.CAST]


# ---- fusions --------------------------------------------------------------------------------
def test_fuse_conv_bn_folds_batch_norm_into_weights() -> None:
    _, out = apply(P.fuse_conv_bn, M.conv_bn_block(rng(1), residual=False))
    assert Op.BATCH_NORM not in ops(out)
    assert next(n.origin for n in out.nodes if n.op is Op.CONV) == "Conv+BatchNormalization"


def test_conv_output_read_elsewhere_is_not_folded() -> None:
    c = 2
    r = rng(2)
    inits = [init("w", r.standard_normal((c, c, 1, 1)).astype(np.float32))] + [
        init(k, r.uniform(0.5, 1.5, c).astype(np.float32)) for k in ("s", "b", "m", "v")]
    nodes = [helper.make_node("Conv", ["x", "w"], ["c"]),
             helper.make_node("BatchNormalization", ["c", "s", "b", "m", "v"], ["n"]),
             helper.make_node("Add", ["n", "c"], ["y"])]
    m = model(nodes, [vi("x", [1, c, 3, 3])], [vi("y", [1, c, 3, 3])], inits)
    _, out = apply(P.fuse_conv_bn, m)
    assert Op.BATCH_NORM in ops(out)


def _act_after(producer: str, act: list[onnx.NodeProto], opset: int = 20,
               extra: list[onnx.TensorProto] | None = None) -> onnx.ModelProto:
    r = rng(4)
    if producer == "Conv":
        base = helper.make_node("Conv", ["x", "w"], ["h"], pads=[1, 1, 1, 1])
        inputs, shape = [vi("x", [1, 2, 5, 5])], [1, 3, 5, 5]
        w = r.standard_normal((3, 2, 3, 3)).astype(np.float32)
    elif producer == "Gemm":
        base = helper.make_node("Gemm", ["x", "w"], ["h"], transB=1)
        inputs, shape = [vi("x", [4, 6])], [4, 3]
        w = r.standard_normal((3, 6)).astype(np.float32)
    else:
        base = helper.make_node("MatMul", ["x", "w"], ["h"])
        inputs, shape = [vi("x", [2, 4, 6])], [2, 4, 3]
        w = r.standard_normal((6, 3)).astype(np.float32)
    return model([base, *act], inputs, [vi("y", shape)], [init("w", w), *(extra or [])], opset)


ACTIVATIONS: dict[str, tuple[list[onnx.NodeProto], list[onnx.TensorProto], str]] = {
    "relu": ([helper.make_node("Relu", ["h"], ["y"])], [], "relu"),
    "leaky": ([helper.make_node("LeakyRelu", ["h"], ["y"], alpha=0.2)], [], "leaky_relu"),
    "sigmoid": ([helper.make_node("Sigmoid", ["h"], ["y"])], [], "sigmoid"),
    "tanh": ([helper.make_node("Tanh", ["h"], ["y"])], [], "tanh"),
    "hard_sigmoid": ([helper.make_node("HardSigmoid", ["h"], ["y"], alpha=0.3, beta=0.4)], [],
                     "hard_sigmoid"),
    "hard_swish": ([helper.make_node("HardSwish", ["h"], ["y"])], [], "hard_swish"),
    "clip": ([helper.make_node("Clip", ["h", "lo", "hi"], ["y"])],
             [init("lo", np.float32(-0.5)), init("hi", np.float32(0.7))], "clip"),
    "clip_max_only": ([helper.make_node("Clip", ["h", "", "hi"], ["y"])],
                      [init("hi", np.float32(0.7))], "clip"),
    "gelu": ([helper.make_node("Gelu", ["h"], ["y"])], [], "gelu"),
    "gelu_tanh": ([helper.make_node("Gelu", ["h"], ["y"], approximate="tanh")], [],
                  "gelu_tanh"),
    "silu": ([helper.make_node("Sigmoid", ["h"], ["s"]), helper.make_node("Mul", ["s", "h"],
                                                                          ["y"])], [], "silu"),
}


@pytest.mark.parametrize("producer", ["Conv", "Gemm", "MatMul"])
@pytest.mark.parametrize("act", sorted(ACTIVATIONS))
def test_fuse_activation_into_epilogues(producer: str, act: str) -> None:
    nodes, extra, name = ACTIVATIONS[act]
    _, out = apply(P.fuse_activation, _act_after(producer, nodes, extra=extra))
    (node,) = out.nodes
    assert node.attrs["activation"] == name and node.outputs == ["y"]


def test_activation_on_a_shared_output_is_not_fused() -> None:
    nodes = [helper.make_node("Relu", ["h"], ["r"]), helper.make_node("Add", ["r", "h"], ["y"])]
    _, out = apply(P.fuse_activation, _act_after("MatMul", nodes))
    assert ops(out) == [Op.MATMUL, Op.RELU, Op.ADD]


def _matmul_add(a_shape: list[int], b_shape: tuple[int, ...], c: np.ndarray) -> onnx.ModelProto:
    r = rng(6)
    nodes = [helper.make_node("MatMul", ["a", "b"], ["h"]), helper.make_node("Add", ["c", "h"],
                                                                             ["y"])]
    return model(nodes, [vi("a", a_shape)], [vi("y", None)],
                 [init("b", r.standard_normal(b_shape).astype(np.float32)), init("c", c)])


def test_fuse_matmul_add_2d_becomes_gemm() -> None:
    _, out = apply(P.fuse_matmul_add, _matmul_add([4, 5], (5, 3), np.ones(3, np.float32)))
    (node,) = out.nodes
    assert node.op is Op.GEMM and node.inputs == ["a", "b", "c"]


def test_fuse_matmul_add_batched_becomes_matmul_with_bias() -> None:
    _, out = apply(P.fuse_matmul_add, _matmul_add([2, 4, 5], (5, 3),
                                                  np.arange(3, dtype=np.float32)))
    (node,) = out.nodes
    assert node.op is Op.MATMUL and node.inputs == ["a", "b", "c"]


def test_add_that_grows_the_result_is_not_a_bias() -> None:
    _, out = apply(P.fuse_matmul_add, _matmul_add([4, 5], (5, 3),
                                                  np.ones((2, 4, 3), np.float32)))
    assert ops(out) == [Op.MATMUL, Op.ADD]


def test_fuse_layer_norm_with_and_without_affine() -> None:
    _, out = apply(P.fuse_layer_norm, M.layer_norm_gelu(rng(8)))
    assert ops(out)[0] is Op.LAYER_NORM and len(out.nodes[0].inputs) == 3
    d = 6
    nodes = [helper.make_node("ReduceMean", ["x"], ["m"], axes=[2]),
             helper.make_node("Sub", ["x", "m"], ["dd"]),
             helper.make_node("Mul", ["dd", "dd"], ["p"]),
             helper.make_node("ReduceMean", ["p"], ["v"], axes=[2]),
             helper.make_node("Add", ["eps", "v"], ["ve"]),
             helper.make_node("Sqrt", ["ve"], ["s"]),
             helper.make_node("Div", ["dd", "s"], ["y"])]
    m = model(nodes, [vi("x", ["N", 3, d])], [vi("y", ["N", 3, d])],
              [init("eps", np.float32(1e-3))])
    _, out = apply(P.fuse_layer_norm, m)
    (node,) = out.nodes
    assert node.op is Op.LAYER_NORM and node.attr("epsilon") == pytest.approx(1e-3)
    np.testing.assert_array_equal(out.initializers[node.inputs[1]], np.ones(d, np.float32))


def test_layer_norm_over_a_non_trailing_axis_is_not_fused() -> None:
    nodes = [helper.make_node("ReduceMean", ["x"], ["m"], axes=[1]),
             helper.make_node("Sub", ["x", "m"], ["dd"]),
             helper.make_node("Pow", ["dd", "two"], ["p"]),
             helper.make_node("ReduceMean", ["p"], ["v"], axes=[1]),
             helper.make_node("Add", ["v", "eps"], ["ve"]),
             helper.make_node("Sqrt", ["ve"], ["s"]),
             helper.make_node("Div", ["dd", "s"], ["y"])]
    m = model(nodes, [vi("x", [2, 3, 4])], [vi("y", [2, 3, 4])],
              [init("eps", np.float32(1e-5)), init("two", np.float32(2))])
    _, out = apply(P.fuse_layer_norm, m)
    assert Op.LAYER_NORM not in ops(out)


def _gelu_model(variant: str) -> onnx.ModelProto:
    c = {"half": np.float32(0.5), "one": np.float32(1.0), "sqrt2": np.float32(math.sqrt(2)),
         "inv_sqrt2": np.float32(1 / math.sqrt(2)), "k": np.float32(0.044715),
         "s": np.float32(math.sqrt(2 / math.pi)), "three": np.float32(3)}
    n = helper.make_node
    head = [n("Div", ["x", "sqrt2"], ["xs"])] if variant != "erf_mul" else \
        [n("Mul", ["inv_sqrt2", "x"], ["xs"])]
    erf = [*head, n("Erf", ["xs"], ["e"]), n("Add", ["one", "e"], ["e1"])]
    forms = {
        "erf_x_then_half": [*erf, n("Mul", ["x", "e1"], ["t"]), n("Mul", ["t", "half"], ["y"])],
        "erf_half_then_x": [*erf, n("Mul", ["e1", "half"], ["t"]), n("Mul", ["x", "t"], ["y"])],
        "erf_mul": [*erf, n("Mul", ["x", "half"], ["h"]), n("Mul", ["h", "e1"], ["y"])],
        "tanh_pow": [n("Pow", ["x", "three"], ["x3"]), n("Mul", ["x3", "k"], ["kx3"]),
                     n("Add", ["x", "kx3"], ["in"]), n("Mul", ["s", "in"], ["arg"]),
                     n("Tanh", ["arg"], ["t"]), n("Add", ["t", "one"], ["t1"]),
                     n("Mul", ["x", "half"], ["h"]), n("Mul", ["h", "t1"], ["y"])],
        "tanh_mulcube": [n("Mul", ["x", "x"], ["x2"]), n("Mul", ["x2", "x"], ["x3"]),
                         n("Mul", ["k", "x3"], ["kx3"]), n("Add", ["kx3", "x"], ["in"]),
                         n("Mul", ["in", "s"], ["arg"]), n("Tanh", ["arg"], ["t"]),
                         n("Add", ["t", "one"], ["t1"]), n("Mul", ["x", "t1"], ["xt"]),
                         n("Mul", ["xt", "half"], ["y"])],
    }
    return model(forms[variant], [vi("x", [3, 5])], [vi("y", [3, 5])],
                 [init(k, v) for k, v in c.items()])


@pytest.mark.parametrize("variant", ["erf_x_then_half", "erf_half_then_x", "erf_mul",
                                     "tanh_pow", "tanh_mulcube"])
def test_fuse_gelu_forms(variant: str) -> None:
    _, out = apply(P.fuse_gelu, _gelu_model(variant))
    (node,) = out.nodes
    assert node.op is Op.GELU and node.inputs == ["x"] and node.outputs == ["y"]
    assert node.attr("approximate") == ("tanh" if variant.startswith("tanh") else "none")


@pytest.mark.parametrize("with_mask", [True, False])
def test_fuse_attention(with_mask: bool) -> None:
    _, out = apply(P.fuse_attention, M.attention(rng(9), with_mask))
    (node,) = out.nodes
    assert node.op is Op.ATTENTION and node.attr("scale") == pytest.approx(0.5)
    assert len(node.inputs) == (4 if with_mask else 3)


def test_fuse_attention_with_pre_transposed_keys_and_mul_scale() -> None:
    n = helper.make_node
    nodes = [n("MatMul", ["q", "kt"], ["qk"]), n("Mul", ["c", "qk"], ["sc"]),
             n("Softmax", ["sc"], ["p"], axis=3), n("MatMul", ["p", "v"], ["y"])]
    m = model(nodes, [vi("q", [1, 2, 3, 4]), vi("kt", [1, 2, 4, 5]), vi("v", [1, 2, 5, 4])],
              [vi("y", [1, 2, 3, 4])], [init("c", np.float32(0.3))])
    _, out = apply(P.fuse_attention, m)
    assert ops(out) == [Op.TRANSPOSE, Op.ATTENTION]


def _sdpa_export(shared_nan_guard: bool = False) -> onnx.ModelProto:
    """Attention as torch exports scaled_dot_product_attention with a KV cache: the scale
    split over Q and Kᵀ, a boolean mask made additive by Where, and the probabilities
    guarded by Where(IsNaN(P), 0, P)."""
    n = helper.make_node
    nodes = [n("Concat", ["past_k", "k"], ["present_k"], axis=-2),
             n("Transpose", ["present_k"], ["kt"], perm=[0, 1, 3, 2]),
             n("Mul", ["q", "c"], ["qs"]), n("Mul", ["kt", "c"], ["kts"]),
             n("MatMul", ["qs", "kts"], ["qk"]),
             n("Where", ["keep", "zero", "minus_inf"], ["bias"]),
             n("Add", ["qk", "bias"], ["scores"]),
             n("Softmax", ["scores"], ["p"], axis=-1),
             n("IsNaN", ["p"], ["nan"]), n("Where", ["nan", "zero", "p"], ["pg"]),
             n("MatMul", ["pg", "v"], ["y"])]
    outputs = [vi("y", [1, 2, 3, 4]), vi("present_k", [1, 2, 5, 4])]
    if shared_nan_guard:
        outputs.append(vi("nan", [1, 2, 3, 5], TensorProto.BOOL))
    return model(nodes, [vi("q", [1, 2, 3, 4]), vi("k", [1, 2, 3, 4]), vi("past_k", [1, 2, 2, 4]),
                         vi("v", [1, 2, 5, 4]), vi("keep", [1, 1, 3, 5], TensorProto.BOOL)],
                 outputs, [init("c", np.array([0.7071], np.float32)),
                           init("zero", np.float32(0)), init("minus_inf", np.float32(-np.inf))])


@pytest.mark.filterwarnings("ignore:invalid value encountered")
def test_fuse_attention_takes_torchs_export_and_keeps_its_nan_guard() -> None:
    r = rng(6)
    keep = r.random((1, 1, 3, 5)) < 0.7
    keep[0, 0, 1] = False                         # query 1 sees no key: zeros, not NaN
    keep[0, 0, [0, 2], 0] = True
    feeds = {name: r.standard_normal(shape).astype(np.float32) for name, shape in
             (("q", (1, 2, 3, 4)), ("k", (1, 2, 3, 4)), ("past_k", (1, 2, 2, 4)),
              ("v", (1, 2, 5, 4)))}
    feeds["keep"] = keep
    _, out = apply(P.fuse_attention, _sdpa_export(), feeds)
    assert ops(out) == [Op.CONCAT, Op.WHERE, Op.ATTENTION, Op.ISNAN, Op.WHERE]
    (fused,) = [node for node in out.nodes if node.op is Op.ATTENTION]
    assert fused.attr("scale") == pytest.approx(0.7071 ** 2)
    assert fused.inputs[1] == "present_k"         # Kᵀ's transpose absorbed
    y = run_graph(out, feeds)["y"]
    assert np.all(y[0, :, 1] == 0) and np.isfinite(y).all()
    # The guard's IsNaN read elsewhere too: nothing fused.
    _, kept = apply(P.fuse_attention, _sdpa_export(shared_nan_guard=True), feeds)
    assert Op.ATTENTION not in ops(kept)


def test_fuse_attention_in_the_transformer_absorbs_the_key_transpose() -> None:
    _, out = apply(P.fuse_attention, M.transformer(rng(2)))
    assert ops(out).count(Op.ATTENTION) == 2 and Op.SOFTMAX not in ops(out)


def test_fuse_residual_moves_the_skip_into_conv() -> None:
    nodes = [helper.make_node("Relu", ["x"], ["r"]),
             helper.make_node("Conv", ["r", "w"], ["c"], pads=[1, 1, 1, 1]),
             helper.make_node("Add", ["x", "c"], ["y"])]
    m = model(nodes, [vi("x", ["N", 2, 4, 4])], [vi("y", ["N", 2, 4, 4])],
              [init("w", rng(1).standard_normal((2, 2, 3, 3)).astype(np.float32))])
    _, out = apply(P.fuse_residual, m)
    assert ops(out) == [Op.RELU, Op.CONV]
    assert out.nodes[1].inputs == ["r", "w", "", "x"] and out.nodes[1].outputs == ["y"]


def _downsample_block(batch: int | str = "N") -> onnx.ModelProto:
    """A ResNet downsampling block as exported: conv1 -> relu -> conv2, then the 1x1
    stride-2 shortcut, both added."""
    r = rng(4)

    def w(*shape: int) -> np.ndarray:
        return r.standard_normal(shape).astype(np.float32)
    nodes = [helper.make_node("Relu", ["x"], ["r"]),
             helper.make_node("Conv", ["r", "w1"], ["c1"], pads=[1, 1, 1, 1], strides=[2, 2]),
             helper.make_node("Relu", ["c1"], ["h"]),
             helper.make_node("Conv", ["h", "w2"], ["c2"], pads=[1, 1, 1, 1]),
             helper.make_node("Conv", ["r", "ws"], ["s"], strides=[2, 2]),
             helper.make_node("Add", ["c2", "s"], ["y"])]
    return model(nodes, [vi("x", [batch, 2, 8, 8])], [vi("y", [batch, 4, 4, 4])],
                 [init("w1", w(4, 2, 3, 3)), init("w2", w(4, 4, 3, 3)),
                  init("ws", w(4, 2, 1, 1))])


def test_order_shared_reads_runs_the_shortcut_beside_the_first_conv() -> None:
    _, out = apply(P.order_shared_reads, _downsample_block())
    assert [n.outputs[0] for n in out.nodes] == ["r", "c1", "h", "s", "c2", "y"]
    assert out.metadata["keel.node_order"].startswith("Conv_")
    assert "both read r" in out.metadata["keel.node_order"]
    again = P.order_shared_reads(out)
    assert snapshot(again) == snapshot(out), "a second run moved something"


def test_after_ordering_the_residual_joins_the_second_conv() -> None:
    out = optimize(import_onnx(_downsample_block()), "extended")
    convs = [n for n in out.nodes if n.op is Op.CONV]
    assert [c.inputs[0] for c in convs] == ["r", "r", "h"]
    assert convs[2].inputs[3] == "s" and convs[2].outputs == ["y"]


def test_explain_says_why_a_node_moved() -> None:
    from keel.execution.model import load_model

    m = load_model(_downsample_block().SerializeToString(), backend="cpu", plan_cache=False)
    feeds = {"x": rng(9).standard_normal((1, 2, 8, 8)).astype(np.float32)}
    m.predict(feeds)
    lines = [ln for ln in m.explain().splitlines() if ln.startswith("node order: ")]
    assert len(lines) == 1 and "both read r (N × 512 B)" in lines[0]
    assert "can find it still in cache" in lines[0]
    assert "after Conv_1's chain (up to Relu_2, fused into it later" in lines[0]
    assert "0 KiB" not in lines[0] and "for any value of the symbolic dimensions" in lines[0]


def test_a_move_names_the_whole_size_of_a_fixed_shape() -> None:
    _, out = apply(P.order_shared_reads, _downsample_block(batch=2))
    note = out.metadata["keel.node_order"]
    assert "both read r (1.0 KiB)" in note and "an image" not in note


def _batch_grown_peak() -> onnx.ModelProto:
    """A MatMul whose move fits with the batch N counted as 1 (a wide fixed value c is
    the peak there) but grows the peak at large N: its N × 2 KiB output would be held
    across the other branch, freeing only the N × 32 B it reads."""
    r = rng(11)

    def w(*shape: int) -> np.ndarray:
        return r.standard_normal(shape).astype(np.float32)
    nodes = [helper.make_node("Relu", ["c"], ["t"]),
             helper.make_node("ReduceSum", ["t"], ["u"], keepdims=1),
             helper.make_node("Relu", ["x"], ["rx"]),
             helper.make_node("MatMul", ["rx", "w1"], ["a"]),
             helper.make_node("MatMul", ["a", "w3"], ["b"]),
             helper.make_node("ReduceSum", ["b", "ax"], ["bb"], keepdims=1),
             helper.make_node("MatMul", ["rx", "w2"], ["s"]),
             helper.make_node("ReduceSum", ["s", "ax"], ["ss"], keepdims=1),
             helper.make_node("Add", ["ss", "bb"], ["y0"]),
             helper.make_node("Add", ["y0", "u"], ["y"])]
    return model(nodes, [vi("x", ["N", 8]), vi("c", [1, 16384])], [vi("y", ["N", 1])],
                 [init("w1", w(8, 8)), init("w3", w(8, 512)), init("w2", w(8, 512)),
                  init("ax", np.array([1], np.int64))], opset=17)


def test_order_shared_reads_keeps_the_order_where_a_large_batch_would_grow_the_peak() -> None:
    from keel.execution.model import load_model

    g, out = apply(P.order_shared_reads, _batch_grown_peak())
    assert snapshot(out) == snapshot(g) and "keel.node_order" not in out.metadata
    blob = _batch_grown_peak().SerializeToString()
    feeds = {"x": rng(12).standard_normal((256, 8)).astype(np.float32),
             "c": rng(13).standard_normal((1, 16384)).astype(np.float32)}
    on = load_model(blob, backend="cpu", plan_cache=False, optimization_level="extended")
    off = load_model(blob, backend="cpu", plan_cache=False, optimization_level="basic")
    on.predict(feeds)
    off.predict(feeds)
    assert on.plan.memory_plan is not None and off.plan.memory_plan is not None
    assert on.plan.memory_plan.live_peak_bytes <= off.plan.memory_plan.live_peak_bytes
    assert not [ln for ln in on.explain().splitlines() if ln.startswith("node order: ")]


def _if_of_blocks() -> onnx.ModelProto:
    """An If whose two branches are each a downsampling block reading the outer x."""
    block = _downsample_block().graph
    made = {o for n in block.node for o in n.output}

    def branch(tag: str) -> onnx.GraphProto:
        nodes = []
        for n in block.node:
            copy_ = helper.make_node(n.op_type, [v + tag if v in made else v for v in n.input],
                                     [o + tag for o in n.output], name=n.name + tag)
            copy_.attribute.extend(n.attribute)
            nodes.append(copy_)
        return helper.make_graph(nodes, "b" + tag, [], [vi("y" + tag, None)])
    node = helper.make_node("If", ["c"], ["y"], name="pick", then_branch=branch("_t"),
                            else_branch=branch("_e"))
    g = helper.make_graph([node], "m", [vi("x", ["N", 2, 8, 8]), vi("c", [], TensorProto.BOOL)],
                          [vi("y", ["N", 4, 4, 4])], list(block.initializer))
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)


def test_explain_shows_the_moves_inside_subgraph_bodies() -> None:
    from keel.execution.model import load_model

    m = load_model(_if_of_blocks().SerializeToString(), backend="cpu", plan_cache=False)
    x = rng(14).standard_normal((1, 2, 8, 8)).astype(np.float32)
    m.predict({"x": x, "c": np.array(True)})
    body = m.graph.nodes[0].attrs["then_branch"]
    assert [n.outputs[0] for n in body.nodes] == ["r_t", "h_t", "s_t", "y_t"]
    lines = [ln for ln in m.explain().splitlines() if ln.startswith("node order: ")]
    assert [ln.split(":")[1] for ln in lines] == [" in pick's then_branch",
                                                  " in pick's else_branch"]
    assert all("both read r_" in ln for ln in lines)


def _repeated_blocks(count: int) -> onnx.ModelProto:
    """``count`` blocks in a row, each with a MatMul that moves beside its sibling."""
    nodes, x = [], "x"
    for k in range(count):
        nodes += [helper.make_node("Relu", [x], [f"r{k}"]),
                  helper.make_node("MatMul", [f"r{k}", "w"], [f"a{k}"]),
                  helper.make_node("Relu", [f"a{k}"], [f"b{k}"]),
                  helper.make_node("MatMul", [f"b{k}", "w"], [f"c{k}"]),
                  helper.make_node("MatMul", [f"r{k}", "w"], [f"s{k}"]),
                  helper.make_node("Add", [f"c{k}", f"s{k}"], [f"y{k}"])]
        x = f"y{k}"
    return model(nodes, [vi("x", ["N", 8])], [vi(x, ["N", 8])],
                 [init("w", np.ones((8, 8), np.float32))])


def test_order_shared_reads_moves_every_block_of_a_long_graph() -> None:
    # 3,600 nodes, 600 moves: each move updates the positions it shifts, and the later
    # blocks' checks see the earlier blocks' moves (speed: docs/graph.md, not a test).
    g = import_onnx(_repeated_blocks(600))
    out = P.order_shared_reads(g)
    assert out.metadata["keel.node_order"].count("\n") == 599
    order = [n.outputs[0] for n in out.nodes]
    for k in (0, 299, 599):
        assert order.index(f"s{k}") == order.index(f"b{k}") + 1


def test_the_record_of_moves_is_this_loads_only() -> None:
    from keel.execution.model import load_model
    from keel.graph.export import to_onnx

    feeds = {"x": rng(15).standard_normal((1, 2, 8, 8)).astype(np.float32)}
    m = load_model(_downsample_block().SerializeToString(), backend="cpu", plan_cache=False)
    m.predict(feeds)
    exported = to_onnx(m.graph)
    assert "keel.node_order" not in {p.key for p in exported.metadata_props}
    # A model that carries a record (as an older export did) shows only what this
    # load's passes moved: nothing in a graph already ordered, at level none or all.
    onnx.helper.set_model_props(exported, {"keel.node_order": "Conv_9 runs after Conv_8"})
    for level in ("none", "all"):
        again = load_model(exported.SerializeToString(), backend="cpu", plan_cache=False,
                           optimization_level=level)
        again.predict(feeds)
        lines = [ln for ln in again.explain().splitlines() if ln.startswith("node order: ")]
        assert not lines and "Conv_9" not in again.explain()
    carried = _downsample_block()
    onnx.helper.set_model_props(carried, {"keel.node_order": "Conv_9 runs after Conv_8"})
    fresh = load_model(carried.SerializeToString(), backend="cpu", plan_cache=False)
    fresh.predict(feeds)
    lines = [ln for ln in fresh.explain().splitlines() if ln.startswith("node order: ")]
    assert len(lines) == 1 and "Conv_9" not in lines[0]


def test_order_shared_reads_keeps_the_order_where_the_peak_would_grow() -> None:
    # Each branch is pooled at once: moved, the wide shortcut would be held across conv2,
    # the two wide maps alive together where they never were.
    r = rng(7)
    nodes = [helper.make_node("Relu", ["x"], ["r"]),
             helper.make_node("Conv", ["r", "w1"], ["c1"], pads=[1, 1, 1, 1], strides=[2, 2]),
             helper.make_node("Relu", ["c1"], ["h"]),
             helper.make_node("Conv", ["h", "w2"], ["c2"], pads=[1, 1, 1, 1]),
             helper.make_node("GlobalAveragePool", ["c2"], ["p"]),
             helper.make_node("Conv", ["r", "ws"], ["s"], strides=[2, 2]),
             helper.make_node("GlobalAveragePool", ["s"], ["q"]),
             helper.make_node("Add", ["p", "q"], ["y"])]
    m = model(nodes, [vi("x", ["N", 2, 8, 8])], [vi("y", ["N", 64, 1, 1])],
              [init(n, r.standard_normal(shape).astype(np.float32)) for n, shape in
               (("w1", (4, 2, 3, 3)), ("w2", (64, 4, 3, 3)), ("ws", (64, 2, 1, 1)))])
    g, out = apply(P.order_shared_reads, m)
    assert snapshot(out) == snapshot(g) and "keel.node_order" not in out.metadata


def test_order_shared_reads_waits_for_every_input() -> None:
    # The Gemm reads r and g; g is made after the first reader's chain ends (h has two
    # readers), so the Gemm cannot move there.
    r = rng(6)
    nodes = [helper.make_node("Relu", ["x"], ["r"]),
             helper.make_node("MatMul", ["r", "w"], ["a"]),
             helper.make_node("Relu", ["a"], ["h"]),
             helper.make_node("Sigmoid", ["h"], ["g"]),
             helper.make_node("Gemm", ["r", "w", "g"], ["s"]),
             helper.make_node("MatMul", ["s", "w"], ["m"]),
             helper.make_node("Add", ["m", "h"], ["y"])]
    m = model(nodes, [vi("x", ["N", 8])], [vi("y", ["N", 8])],
              [init("w", r.standard_normal((8, 8)).astype(np.float32))])
    g, out = apply(P.order_shared_reads, m)
    assert snapshot(out) == snapshot(g)


def test_readers_already_in_a_row_keep_their_order() -> None:
    # Three projections of x, each with its activation: the third stays after the second.
    r = rng(8)
    nodes = [helper.make_node("Relu", ["x"], ["r"])]
    for k in "qkv":
        nodes += [helper.make_node("MatMul", ["r", f"w{k}"], [f"{k}0"]),
                  helper.make_node("Relu", [f"{k}0"], [k])]
    nodes += [helper.make_node("Sum", ["q", "k", "v"], ["y"])]
    m = model(nodes, [vi("x", ["N", 8])], [vi("y", ["N", 8])],
              [init(f"w{k}", r.standard_normal((8, 8)).astype(np.float32)) for k in "qkv"])
    g, out = apply(P.order_shared_reads, m)
    assert snapshot(out) == snapshot(g)


def test_broadcast_add_after_conv_is_not_a_residual() -> None:
    nodes = [helper.make_node("Conv", ["x", "w"], ["c"]), helper.make_node("Add", ["c", "b"],
                                                                           ["y"])]
    m = model(nodes, [vi("x", [1, 2, 3, 3])], [vi("y", [1, 2, 3, 3])],
              [init("w", np.ones((2, 2, 1, 1), np.float32)),
               init("b", np.ones((1, 2, 1, 1), np.float32))])
    _, out = apply(P.fuse_residual, m)
    assert ops(out) == [Op.CONV, Op.ADD]


@pytest.mark.parametrize("p, q, expect", [
    ([0, 2, 3, 1], [0, 3, 1, 2], [Op.IDENTITY]),
    ([0, 2, 3, 1], [0, 2, 1, 3], [Op.TRANSPOSE]),
])
def test_cancel_transposes(p: list[int], q: list[int], expect: list[Op]) -> None:
    nodes = [helper.make_node("Transpose", ["x"], ["a"], perm=p),
             helper.make_node("Transpose", ["a"], ["y"], perm=q)]
    m = model(nodes, [vi("x", [1, 2, 3, 4])], [vi("y", None)])
    _, out = apply(P.cancel_transposes, m)
    assert ops(out) == expect


# ---- levels --------------------------------------------------------------------------------
def test_unknown_level_is_an_invalid_argument() -> None:
    g = import_onnx(M.mlp(rng(0)))
    with pytest.raises(InvalidArgumentError, match="unknown optimization level 'max'; allowed: "
                                                   "none, basic, extended, all"):
        optimize(g, "max")


def test_level_none_changes_nothing_and_levels_grow() -> None:
    g = import_onnx(M.transformer(rng(0)))
    counts = [len(optimize(g, level).nodes) for level in LEVELS]
    assert counts[0] == len(g.nodes) and counts == sorted(counts, reverse=True)
    assert counts[-1] < counts[1]


def test_report_lists_passes_that_changed_the_graph() -> None:
    g = import_onnx(M.conv_bn_block(rng(0)))
    rep = optimize_with_report(g, "all")
    assert rep.applied[:3] == ["fuse_conv_bn", "fuse_residual", "fuse_activation"]
    assert all(r.nodes_after <= r.nodes_before for r in rep.records)
    assert copy.copy(rep.graph).output_names == g.output_names


DONE_WHEN = {"mlp": M.mlp, "lenet": M.lenet, "resnet_block": M.conv_bn_block,
             "mobilenet_block": M.mobilenet_block, "transformer": M.transformer}


@pytest.mark.parametrize("name", sorted(DONE_WHEN))
@pytest.mark.parametrize("batch", [1, 32])
def test_optimized_models_match_onnxruntime_at_every_level(name: str, batch: int) -> None:
    r = rng(11)
    m = DONE_WHEN[name](r)
    g = import_onnx(m)
    feeds = feeds_of(g, r, batch)
    want = M.run_ort(m, feeds)
    for level in LEVELS:
        out = optimize(g, level)
        got = run_graph(out, feeds)
        for o, expected in zip(out.output_names, want, strict=True):
            assert rel_l2(got[o], expected) < 1e-4, (level, o)
