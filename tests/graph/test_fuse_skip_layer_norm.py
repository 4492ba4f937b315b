"""Residual Add + LayerNorm fusion into SKIP_LAYER_NORM: where it applies, where it must
not, the results against onnxruntime (reference interpreter and keel's cpu executor), and
the export back to Add + LayerNormalization."""

from __future__ import annotations

from typing import Any

import numpy as np
import onnx
import pytest
from onnx import helper

import keel
from keel.graph.export import to_onnx
from keel.graph.importers.onnx import KEEL_DOMAIN, import_onnx
from keel.graph.ir import Graph, Node
from keel.graph.passes import optimize, optimize_with_report
from keel.graph.passes.fuse_skip_layer_norm import fuse_skip_layer_norm
from keel.ops.registry import Op
from tests.graph import models as M
from tests.graph.interp import run_graph
from tests.graph.models import init, model, rel_l2, rng, vi

SEQ, D = 5, 24


def _block(r: np.random.Generator, *, sum_out: bool = False, sum_reader: str = "",
           stats: bool = False, bias: bool = True, skip_shape: tuple[int, ...] | None = None,
           x_shape: tuple[Any, ...] = ("N", SEQ, D)) -> onnx.ModelProto:
    """x → Linear → Add(x, ·) → LayerNormalization → y, BERT's post-norm residual.

    ``sum_out``: the sum is a graph output too; ``sum_reader``: "after" or "before" adds
    a Relu of the sum placed after / before the LayerNorm in node order; ``stats``: the
    LayerNorm's Mean is an output; ``skip_shape``: add a constant of that shape instead
    of the Linear."""
    inits = [init("g", r.uniform(0.5, 1.5, D).astype(np.float32)),
             init("beta", (r.standard_normal(D) * 0.1).astype(np.float32)),
             init("w", (r.standard_normal((D, D)) / np.sqrt(D)).astype(np.float32)),
             init("b", (r.standard_normal(D) * 0.1).astype(np.float32))]
    nodes = []
    if skip_shape is None:
        nodes += [helper.make_node("MatMul", ["x", "w"], ["mm"]),
                  helper.make_node("Add", ["mm", "b"], ["lin"])]
        other = "lin"
    else:
        inits.append(init("pos", r.standard_normal(skip_shape).astype(np.float32)))
        other = "pos"
    nodes.append(helper.make_node("Add", ["x", other], ["s"]))
    relu = helper.make_node("Relu", ["s"], ["r"])
    if sum_reader == "before":
        nodes.append(relu)
    ln_outs = ["y", "mean"] if stats else ["y"]
    params = ["g", "beta"] if bias else ["g"]
    nodes.append(helper.make_node("LayerNormalization", ["s", *params], ln_outs, axis=-1,
                                  epsilon=1e-5))
    if sum_reader == "after":
        nodes.append(relu)
    outputs = [vi("y", list(x_shape))]
    outputs += [vi("s", list(x_shape))] if sum_out else []
    outputs += [vi("r", list(x_shape))] if sum_reader else []
    outputs += [vi("mean", None)] if stats else []
    return model(nodes, [vi("x", list(x_shape))], outputs, inits, opset=17)


def _feeds(batch: int = 3, shape: tuple[int, ...] = (SEQ, D)) -> dict[str, np.ndarray]:
    return {"x": (rng(8).standard_normal((batch, *shape)) * 2 + 1).astype(np.float32)}


def _fused(g: Graph) -> list[Node]:
    return [n for n in g.nodes if n.op is Op.SKIP_LAYER_NORM]


def _check_against_onnxruntime(m: onnx.ModelProto, g: Graph,
                               feeds: dict[str, np.ndarray]) -> None:
    want = M.run_ort(m, feeds)
    got = run_graph(g, feeds)
    for name, expected in zip(g.output_names, want, strict=True):
        assert got[name].shape == expected.shape
        assert rel_l2(got[name], expected) < 1e-6, name


def test_post_norm_residual_becomes_one_node_matching_onnxruntime() -> None:
    m = _block(rng(0))
    g = import_onnx(m)
    out = fuse_skip_layer_norm(optimize(g, "basic"))
    assert [n.op for n in out.nodes] == [Op.MATMUL, Op.ADD, Op.SKIP_LAYER_NORM]
    node = out.nodes[-1]
    assert node.inputs[:2] == ["x", "lin"] and len(node.inputs) == 4 and node.outputs == ["y"]
    _check_against_onnxruntime(m, out, _feeds())
    full = optimize(g, "all")
    assert [n.op for n in full.nodes] == [Op.MATMUL, Op.SKIP_LAYER_NORM]
    assert "fuse_skip_layer_norm" in optimize_with_report(g, "extended").applied
    assert _fused(optimize(g, "basic")) == []
    _check_against_onnxruntime(m, full, _feeds())


@pytest.mark.parametrize("batch", [1, 4])
def test_keel_cpu_model_matches_onnxruntime(batch: int) -> None:
    m = _block(rng(1), sum_out=True)
    feeds = _feeds(batch)
    model_ = keel.load_model(m.SerializeToString(), backend="cpu", threads=1)
    assert "skip_layer_norm" in model_.explain()
    got = model_.predict(feeds)
    for name, expected in zip(("y", "s"), M.run_ort(m, feeds), strict=True):
        np.testing.assert_allclose(got[name], expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("where", ["output", "after"])
def test_a_sum_read_elsewhere_is_the_second_output(where: str) -> None:
    m = _block(rng(2), sum_out=where == "output", sum_reader="after" if where == "after" else "")
    out = optimize(import_onnx(m), "all")
    (node,) = _fused(out)
    assert node.outputs == ["y", "s"]
    _check_against_onnxruntime(m, out, _feeds())


def test_what_is_not_fused() -> None:
    cases = {
        "sum read before the LayerNorm": _block(rng(3), sum_reader="before"),
        "Mean output read": _block(rng(3), stats=True),
        "the Add grows both operands": _block(rng(3), skip_shape=(1, SEQ, D),
                                              x_shape=("N", 1, D)),
    }
    for why, m in cases.items():
        out = optimize(import_onnx(m), "all")
        assert _fused(out) == [], why
        assert Op.LAYER_NORM in [n.op for n in out.nodes], why
        shape = (1, D) if "grows" in why else (SEQ, D)
        want = M.run_ort(m, _feeds(shape=shape))
        got = run_graph(out, _feeds(shape=shape))
        for name, expected in zip(out.output_names, want, strict=True):
            assert rel_l2(got[name], expected) < 1e-6, why


@pytest.mark.parametrize("skip_shape", [(SEQ, D), (D,), (1, 1, SEQ, D), (1, SEQ, 1)])
def test_a_broadcast_skip_is_fused(skip_shape: tuple[int, ...]) -> None:
    m = _block(rng(4), skip_shape=skip_shape, bias=False)
    out = optimize(import_onnx(m), "all")
    if len(skip_shape) > 3:                       # the Add would grow X's rank: left alone
        assert _fused(out) == []
    else:
        (node,) = _fused(out)
        assert node.inputs[:2] == ["x", "pos"] and len(node.inputs) == 3
    _check_against_onnxruntime(m, out, _feeds())
    model_ = keel.load_model(m.SerializeToString(), backend="cpu", threads=1)
    np.testing.assert_allclose(model_.predict(_feeds())["y"], M.run_ort(m, _feeds())[0],
                               rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("sum_out", [False, True])
def test_export_decomposes_into_add_and_layer_normalization(sum_out: bool) -> None:
    m = _block(rng(5), sum_out=sum_out)
    g = optimize(import_onnx(m), "all")
    assert len(_fused(g)) == 1
    exported = to_onnx(g)
    onnx.checker.check_model(exported, full_check=True)
    types = [n.op_type for n in exported.graph.node]
    assert types[-2:] == ["Add", "LayerNormalization"]
    feeds = _feeds()
    for got, want in zip(M.run_ort(exported, feeds), M.run_ort(m, feeds), strict=True):
        assert rel_l2(got, want) < 1e-6
    again = optimize(import_onnx(exported), "all")
    assert [n.op for n in again.nodes] == [n.op for n in g.nodes]


def test_keel_domain_export_reimports_the_fused_node() -> None:
    m = _block(rng(6), sum_out=True)
    g = optimize(import_onnx(m), "all")
    exported = to_onnx(g, custom_domain=True)
    (node,) = [n for n in exported.graph.node if n.op_type == Op.SKIP_LAYER_NORM.value]
    assert node.domain == KEEL_DOMAIN
    back = import_onnx(exported.SerializeToString())
    (fused,) = _fused(back)
    assert fused.outputs == ["y", "s"] and fused.attrs.keys() == _fused(g)[0].attrs.keys()
    feeds = _feeds()
    want, got = run_graph(g, feeds), run_graph(back, feeds)
    for k in want:
        assert rel_l2(got[k], want[k]) < 1e-6


def test_pre_norm_transformer_fuses_every_residual() -> None:
    m = M.transformer(rng(7))
    g = optimize(import_onnx(m), "all")
    fused = _fused(g)
    assert len(fused) == 5 and Op.LAYER_NORM not in [n.op for n in g.nodes]
    assert [len(n.outputs) for n in fused] == [2, 2, 2, 2, 1]    # the last sum is read once
    feeds = M.token_feeds(3, rng(7))
    for got, want in zip(M.run_ort(to_onnx(g), feeds), M.run_ort(m, feeds), strict=True):
        assert rel_l2(got, want) < 1e-5
