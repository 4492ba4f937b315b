"""Conformance cases of control flow (If, Loop, Scan, SequenceMap) and of the sequence and
optional ops.

A control-flow kernel receives its subgraphs compiled (``keel.execution.control``):
the cases build each body as a keel Graph and compile it the way a loaded model
does, so every backend runs the same bodies and differs only in the kernel that
sequences them. Sequence inputs and outputs are lists of arrays.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from keel.dtypes import DType
from keel.execution.control import CompiledBody
from keel.graph.ir import Graph, Node, Value
from keel.ops.registry import Op
from keel.ops.types import TensorType
from tests.conformance.harness import OpCase

F32, I64 = np.float32, np.int64
Gen = np.random.Generator


def _t(shape: tuple[int | None, ...] | None, dtype: DType = DType.FLOAT32) -> TensorType:
    return TensorType(dtype, shape)


def _body(nodes: list[Node], inputs: list[Value], outputs: list[Value]) -> CompiledBody:
    graph = Graph("body", nodes, inputs, outputs)
    graph.verify()
    return CompiledBody(graph, None, "reference", "auto")


def _if_bodies() -> dict[str, Any]:
    ab = [Value("a", _t((3, 4))), Value("b", _t((3, 4)))]
    then = _body([Node("add", Op.ADD, ["a", "b"], ["y"])], ab, [Value("y", _t((3, 4)))])
    other = _body([Node("sub", Op.SUB, ["a", "b"], ["z"])], ab, [Value("z", _t((3, 4)))])
    return {"then_branch": then, "else_branch": other, "captures": ("a", "b")}


def _loop_body() -> dict[str, Any]:
    """acc += x each iteration; the scan output is acc * i; stop once the sum passes 40."""
    inputs = [Value("i", _t((), DType.INT64)), Value("cond", _t((), DType.BOOL)),
              Value("acc", _t((2, 3))), Value("x", _t((2, 3)))]
    nodes = [Node("add", Op.ADD, ["acc", "x"], ["acc_out"]),
             Node("cast", Op.CAST, ["i"], ["fi"], {"to": DType.FLOAT32}),
             Node("mul", Op.MUL, ["acc_out", "fi"], ["scanned"]),
             Node("sum", Op.SUM_ALL, ["acc_out"], ["total"]),
             Node("less", Op.LESS, ["total", "limit"], ["go"])]
    graph = Graph("body", nodes, inputs,
                  [Value("go", _t((), DType.BOOL)), Value("acc_out", _t((2, 3))),
                   Value("scanned", _t((2, 3)))],
                  {"limit": np.array(40.0, F32)})
    return {"body": CompiledBody(graph, None, "reference", "auto"), "captures": ("x",)}


def _scan_body(axis: int = 0) -> dict[str, Any]:
    """A running sum over the rows: state += row; each step gives the state."""
    inputs = [Value("s", _t((4,))), Value("row", _t((4,)))]
    nodes = [Node("add", Op.ADD, ["s", "row"], ["s_out"]),
             Node("copy", Op.IDENTITY, ["s_out"], ["y"])]
    body = _body(nodes, inputs, [Value("s_out", _t((4,))), Value("y", _t((4,)))])
    return {"body": body, "num_scan_inputs": 1, "scan_input_axes": (axis,)}


def _square_body() -> dict[str, Any]:
    body = _body([Node("mul", Op.MUL, ["e", "e"], ["sq"])], [Value("e", _t(None))],
                 [Value("sq", _t(None))])
    return {"body": body}


def _seq(rng: Gen, *shapes: tuple[int, ...]) -> list[np.ndarray]:
    return [rng.standard_normal(s).astype(F32) for s in shapes]


def _cases() -> list[OpCase]:
    return [
        OpCase("if-then", Op.IF, lambda rng: [np.array(True), *_seq(rng, (3, 4), (3, 4))],
               _if_bodies()),
        OpCase("if-else", Op.IF, lambda rng: [np.array([False]), *_seq(rng, (3, 4), (3, 4))],
               _if_bodies()),
        OpCase("loop-trip-count", Op.LOOP,
               lambda rng: [np.array(3, I64), None, *_seq(rng, (2, 3)),
                            np.abs(_seq(rng, (2, 3))[0])], _loop_body()),
        OpCase("loop-until-cond", Op.LOOP,
               lambda rng: [np.array(100, I64), np.array(True), np.zeros((2, 3), F32),
                            np.full((2, 3), 1.5, F32)], _loop_body()),
        OpCase("loop-no-iteration", Op.LOOP,
               lambda rng: [np.array(0, I64), np.array(True), *_seq(rng, (2, 3), (2, 3))],
               _loop_body()),
        OpCase("scan-rows", Op.SCAN, lambda rng: [np.zeros(4, F32), *_seq(rng, (5, 4))],
               _scan_body()),
        OpCase("scan-columns-reversed", Op.SCAN,
               lambda rng: [np.ones(4, F32), *_seq(rng, (4, 6))],
               {**_scan_body(1), "scan_input_directions": (1,),
                "scan_output_directions": (1,)}),
        OpCase("sequence-map", Op.SEQUENCE_MAP,
               lambda rng: [_seq(rng, (2,), (3, 2), ())], _square_body()),
        OpCase("sequence-construct", Op.SEQUENCE_CONSTRUCT,
               lambda rng: _seq(rng, (2, 3), (4,), ())),
        OpCase("sequence-empty", Op.SEQUENCE_EMPTY, lambda rng: [], {"dtype": DType.INT64}),
        OpCase("sequence-insert-end", Op.SEQUENCE_INSERT,
               lambda rng: [_seq(rng, (2,), (3,)), *_seq(rng, (4,))]),
        OpCase("sequence-insert-front", Op.SEQUENCE_INSERT,
               lambda rng: [_seq(rng, (2,), (3,)), *_seq(rng, (4,)), np.array(-2, I64)]),
        OpCase("sequence-erase", Op.SEQUENCE_ERASE,
               lambda rng: [_seq(rng, (2,), (3,), (1,)), np.array(1, I64)]),
        OpCase("sequence-erase-last", Op.SEQUENCE_ERASE,
               lambda rng: [_seq(rng, (2,), (3,), (1,))]),
        OpCase("sequence-at", Op.SEQUENCE_AT,
               lambda rng: [_seq(rng, (2,), (3, 3)), np.array(-1, I64)]),
        OpCase("sequence-length", Op.SEQUENCE_LENGTH,
               lambda rng: [_seq(rng, (2,), (3,), (5,))]),
        OpCase("split-to-sequence-ones", Op.SPLIT_TO_SEQUENCE,
               lambda rng: _seq(rng, (3, 4)), {"axis": 1, "keepdims": False}),
        OpCase("split-to-sequence-sizes", Op.SPLIT_TO_SEQUENCE,
               lambda rng: [*_seq(rng, (5, 2)), np.array([1, 4], I64)]),
        OpCase("split-to-sequence-step", Op.SPLIT_TO_SEQUENCE,
               lambda rng: [*_seq(rng, (7, 2)), np.array(3, I64)]),
        OpCase("concat-from-sequence", Op.CONCAT_FROM_SEQUENCE,
               lambda rng: [_seq(rng, (2, 3), (4, 3))], {"axis": 0}),
        OpCase("concat-from-sequence-new-axis", Op.CONCAT_FROM_SEQUENCE,
               lambda rng: [_seq(rng, (2, 3), (2, 3))], {"axis": -1, "new_axis": True}),
        OpCase("optional-tensor", Op.OPTIONAL, lambda rng: _seq(rng, (3,))),
        OpCase("optional-sequence", Op.OPTIONAL, lambda rng: [_seq(rng, (3,), (1,))]),
        OpCase("optional-has-element", Op.OPTIONAL_HAS_ELEMENT, lambda rng: _seq(rng, (2,))),
        OpCase("optional-has-no-element", Op.OPTIONAL_HAS_ELEMENT, lambda rng: [None]),
        OpCase("optional-get-element", Op.OPTIONAL_GET_ELEMENT,
               lambda rng: [_seq(rng, (2,), (2, 2))]),
    ]


CASES = _cases()
