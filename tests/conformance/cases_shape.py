"""Conformance cases of the shape family.

Each case builds its inputs from the generator it is given. Shape-like inputs
(Reshape's shape, Pad's pads, …) are int64 arrays, as an ONNX graph passes
them. Cases named ``*-nc`` feed a non-contiguous input (a transposed or
strided view), ``*-empty`` a zero-size one.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from keel.ops.registry import Op
from tests.conformance.harness import OpCase

Gen = np.random.Generator
Make = Callable[[Gen], list[np.ndarray | None]]

DTYPES = ("float32", "float16", "float64", "int64", "int32", "uint8", "bool")


def rand(rng: Gen, shape: Sequence[int], dtype: str = "float32") -> np.ndarray:
    """Random values of ``dtype`` (small integers, booleans, normal floats)."""
    dt, dims = np.dtype(dtype), tuple(shape)
    values: np.ndarray
    if dt.kind == "b":
        values = rng.random(dims) < 0.5
    elif dt.kind == "u":
        values = rng.integers(0, 200, size=dims)
    elif dt.kind == "i":
        values = rng.integers(-50, 50, size=dims)
    else:
        values = rng.standard_normal(dims)
    return np.asarray(values, dtype=dt)    # 0-d arrays, never NumPy scalars


def i64(*values: int) -> np.ndarray:
    return np.array(values, dtype=np.int64)


def data(shape: Sequence[int], dtype: str = "float32", *extra: np.ndarray | None,
         view: Callable[[np.ndarray], np.ndarray] | None = None) -> Make:
    """Inputs: one random tensor (optionally seen through ``view``) and fixed extras."""
    def make(rng: Gen) -> list[np.ndarray | None]:
        x = rand(rng, shape, dtype)
        return [x if view is None else view(x), *extra]
    return make


def transposed(x: np.ndarray) -> np.ndarray:
    return x.T


def strided(x: np.ndarray) -> np.ndarray:
    return x[..., ::2]


def case(id: str, op: Op, inputs: Make, **attrs: Any) -> OpCase:
    return OpCase(id, op, inputs, attrs)


def _per_dtype(prefix: str, op: Op, shape: Sequence[int], *extra: np.ndarray | None,
               **attrs: Any) -> list[OpCase]:
    return [case(f"{prefix}-{dt}", op, data(shape, dt, *extra), **attrs) for dt in DTYPES]


RESHAPE = [
    *_per_dtype("reshape-copy-infer", Op.RESHAPE, (2, 3, 4), i64(0, -1)),
    case("reshape-attr-f32", Op.RESHAPE, data((2, 3, 4)), shape=(4, -1)),
    case("reshape-allowzero-empty", Op.RESHAPE, data((0, 3), "float32", i64(3, 0)), allowzero=1),
    case("reshape-empty-copy", Op.RESHAPE, data((0, 3, 2), "float32", i64(0, 6))),
    case("reshape-nc", Op.RESHAPE, data((4, 6), "float32", i64(-1), view=transposed)),
    case("reshape-strided", Op.RESHAPE, data((3, 8), "int64", i64(3, 2, 2), view=strided)),
    case("reshape-scalar", Op.RESHAPE, data((1, 1), "float64", i64())),
]

EXPAND_DIMS = [
    case("expand_dims-axis-neg", Op.EXPAND_DIMS, data((2, 3)), axis=-1),
    case("expand_dims-axes-input", Op.EXPAND_DIMS, data((2, 3), "int64", i64(0, -1))),
    case("expand_dims-axes-attr-bool", Op.EXPAND_DIMS, data((3,), "bool"), axes=(1, 0)),
    case("expand_dims-empty", Op.EXPAND_DIMS, data((0, 4), "float16"), axis=1),
    case("expand_dims-nc", Op.EXPAND_DIMS, data((3, 5), view=transposed), axis=0),
    case("expand_dims-scalar", Op.EXPAND_DIMS, data((), "float32"), axis=0),
]

SQUEEZE = [
    case("squeeze-all", Op.SQUEEZE, data((1, 3, 1, 2))),
    case("squeeze-axes-input-neg", Op.SQUEEZE, data((1, 3, 1, 2), "int32", i64(-2))),
    case("squeeze-axes-attr", Op.SQUEEZE, data((1, 3, 1), "uint8"), axes=(0, 2)),
    case("squeeze-empty", Op.SQUEEZE, data((0, 1, 2), "float16"), axes=(1,)),
    case("squeeze-nc", Op.SQUEEZE, data((4, 1, 3), view=transposed)),
    case("squeeze-to-scalar", Op.SQUEEZE, data((1, 1), "bool")),
]

TRANSPOSE = [
    *[case(f"transpose-perm-{dt}", Op.TRANSPOSE, data((2, 3, 4), dt), perm=(1, 2, 0))
      for dt in DTYPES],
    case("transpose-default", Op.TRANSPOSE, data((2, 3, 4))),
    case("transpose-neg-perm", Op.TRANSPOSE, data((2, 3, 4)), perm=(-1, 0, 1)),
    case("transpose-empty", Op.TRANSPOSE, data((0, 3)), perm=(1, 0)),
    case("transpose-nc", Op.TRANSPOSE, data((3, 4, 5), "float64", view=strided), perm=(2, 0, 1)),
    case("transpose-scalar", Op.TRANSPOSE, data((), "float32")),
]

FLATTEN = [
    case("flatten-default", Op.FLATTEN, data((2, 3, 4))),
    case("flatten-axis0-i64", Op.FLATTEN, data((2, 3, 4), "int64"), axis=0),
    case("flatten-axis-neg", Op.FLATTEN, data((2, 3, 4), "float16"), axis=-1),
    case("flatten-axis-rank", Op.FLATTEN, data((2, 3), "bool"), axis=2),
    case("flatten-empty", Op.FLATTEN, data((2, 0, 4)), axis=2),
    case("flatten-nc", Op.FLATTEN, data((3, 4, 5), view=transposed), axis=1),
]

EXPAND = [
    *_per_dtype("expand-bidirectional", Op.EXPAND, (3, 1), i64(2, 1, 4)),
    case("expand-attr", Op.EXPAND, data((1, 3)), shape=(2, 3)),
    case("expand-smaller-shape", Op.EXPAND, data((2, 3), "float32", i64(3))),
    case("expand-empty", Op.EXPAND, data((0, 1), "float32", i64(0, 5))),
    case("expand-nc", Op.EXPAND, data((3, 1), "float32", i64(4, 1, 3), view=transposed)),
    case("expand-scalar", Op.EXPAND, data((), "int64", i64(2, 2))),
]

SHAPE = [
    case("shape-all", Op.SHAPE, data((2, 3, 4))),
    case("shape-start-end", Op.SHAPE, data((2, 3, 4, 5), "int64"), start=1, end=-1),
    case("shape-clamped", Op.SHAPE, data((2, 3), "bool"), start=-10, end=10),
    case("shape-empty-range", Op.SHAPE, data((2, 3)), start=2, end=1),
    case("shape-scalar", Op.SHAPE, data((), "float16")),
    case("shape-zero-size-nc", Op.SHAPE, data((0, 3), view=transposed)),
]

SIZE = [
    case("size-f32", Op.SIZE, data((2, 3, 4))),
    case("size-empty", Op.SIZE, data((0, 3), "int64")),
    case("size-scalar", Op.SIZE, data((), "bool")),
]


def _concat_inputs(shapes: Sequence[Sequence[int]], dtype: str,
                   nc: bool = False) -> Make:
    def make(rng: Gen) -> list[np.ndarray | None]:
        arrays = [rand(rng, s, dtype) for s in shapes]
        return [a.T if nc else a for a in arrays]
    return make


CONCAT = [
    *[case(f"concat-axis1-{dt}", Op.CONCAT, _concat_inputs([(2, 3), (2, 1), (2, 4)], dt),
           axis=1) for dt in DTYPES],
    case("concat-axis-neg", Op.CONCAT, _concat_inputs([(2, 3, 1), (2, 3, 2)], "float32"),
         axis=-1),
    case("concat-single", Op.CONCAT, _concat_inputs([(3, 2)], "int64"), axis=0),
    case("concat-empty-part", Op.CONCAT, _concat_inputs([(0, 3), (2, 3)], "float32"), axis=0),
    case("concat-nc", Op.CONCAT, _concat_inputs([(3, 2), (3, 4)], "float64", nc=True), axis=0),
]

SPLIT = [
    *_per_dtype("split-sizes", Op.SPLIT, (2, 6), i64(1, 2, 3), axis=1),
    case("split-attr-neg-axis", Op.SPLIT, data((4, 5)), axis=-1, split=(2, 3)),
    case("split-num-outputs-even", Op.SPLIT, data((6, 2)), num_outputs=3),
    case("split-num-outputs-uneven", Op.SPLIT, data((7, 2), "int64"), num_outputs=3),
    case("split-zero-piece", Op.SPLIT, data((2, 3), "float32", i64(0, 3, 0)), axis=1),
    case("split-nc", Op.SPLIT, data((5, 4), "float32", i64(2, 3), view=transposed), axis=1),
]

TILE = [
    *_per_dtype("tile", Op.TILE, (2, 3), i64(2, 3)),
    case("tile-attr", Op.TILE, data((2, 1, 3)), repeats=(1, 4, 2)),
    case("tile-zero-repeat", Op.TILE, data((2, 3), "float32", i64(0, 2))),
    case("tile-empty", Op.TILE, data((0, 3), "float32", i64(3, 1))),
    case("tile-nc", Op.TILE, data((3, 4), "float32", i64(2, 2), view=transposed)),
]

PAD = [
    *_per_dtype("pad-constant", Op.PAD, (2, 3), i64(1, 0, 2, 2)),
    case("pad-constant-value", Op.PAD, data((2, 3), "float32", i64(1, 1, 1, 1),
                                            np.array(2.5, np.float32))),
    case("pad-constant-attr", Op.PAD, data((3, 2), "int64"), pads=(0, 1, 2, 0), value=7),
    case("pad-negative-crop", Op.PAD, data((4, 5), "float32", i64(-1, 2, 1, -2))),
    case("pad-axes-input", Op.PAD, data((2, 3, 4), "float32", i64(1, 2, 0, 1), None,
                                        i64(-1, 0))),
    *[case(f"pad-{mode}-{dt}", Op.PAD, data((3, 4), dt, i64(2, 1, 1, 3)), mode=mode)
      for mode in ("reflect", "edge", "wrap") for dt in ("float32", "int64", "float16")],
    case("pad-wrap-long", Op.PAD, data((2, 3), "float32", i64(0, 7, 0, 4)), mode="wrap"),
    case("pad-edge-crop", Op.PAD, data((4, 4), "float32", i64(2, -2, -1, 3)), mode="edge"),
    case("pad-reflect-crop", Op.PAD, data((5, 4), "float64", i64(-1, 2, 2, 1)), mode="reflect"),
    case("pad-empty-constant", Op.PAD, data((0, 3), "float32", i64(1, 0, 1, 0))),
    case("pad-nc", Op.PAD, data((4, 3), "float32", i64(1, 1, 2, 0), view=transposed),
         mode="reflect"),
]

DEPTH_TO_SPACE = [
    *[case(f"depth_to_space-{mode}-{dt}", Op.DEPTH_TO_SPACE, data((2, 8, 3, 2), dt),
           blocksize=2, mode=mode) for mode in ("DCR", "CRD") for dt in ("float32", "int64")],
    case("depth_to_space-b3", Op.DEPTH_TO_SPACE, data((1, 9, 2, 2), "float16"), blocksize=3),
    case("depth_to_space-empty", Op.DEPTH_TO_SPACE, data((0, 4, 2, 2)), blocksize=2),
    case("depth_to_space-nc", Op.DEPTH_TO_SPACE, data((2, 2, 4, 1), view=transposed),
         blocksize=2),
]

SPACE_TO_DEPTH = [
    case("space_to_depth-f32", Op.SPACE_TO_DEPTH, data((2, 3, 4, 6)), blocksize=2),
    case("space_to_depth-bool", Op.SPACE_TO_DEPTH, data((1, 2, 6, 3), "bool"), blocksize=3),
    case("space_to_depth-crd-i64", Op.SPACE_TO_DEPTH, data((2, 3, 4, 2), "int64"), blocksize=2,
         mode="CRD"),
    case("space_to_depth-empty", Op.SPACE_TO_DEPTH, data((0, 2, 2, 2)), blocksize=2),
    case("space_to_depth-nc", Op.SPACE_TO_DEPTH, data((4, 4, 2, 1), view=transposed),
         blocksize=2),
]


def _fixed(*arrays: np.ndarray) -> Make:
    return lambda rng: list(arrays)


CONSTANT_OF_SHAPE = [
    case("constant_of_shape-default", Op.CONSTANT_OF_SHAPE, _fixed(i64(2, 3))),
    case("constant_of_shape-int64", Op.CONSTANT_OF_SHAPE, _fixed(i64(4)),
         value=np.array([7], dtype=np.int64)),
    case("constant_of_shape-f16", Op.CONSTANT_OF_SHAPE, _fixed(i64(2, 1, 2)),
         value=np.array([1.5], dtype=np.float16)),
    case("constant_of_shape-bool", Op.CONSTANT_OF_SHAPE, _fixed(i64(3)),
         value=np.array([True])),
    case("constant_of_shape-empty", Op.CONSTANT_OF_SHAPE, _fixed(i64(0, 3))),
    case("constant_of_shape-scalar", Op.CONSTANT_OF_SHAPE, _fixed(i64()),
         value=np.array([2.0], dtype=np.float64)),
]


def _scalars(dtype: str, *values: float) -> Make:
    return _fixed(*(np.array(v, dtype=dtype) for v in values))


RANGE = [
    case("range-int64", Op.RANGE, _scalars("int64", 2, 17, 3)),
    case("range-int32-neg", Op.RANGE, _scalars("int32", 10, -5, -4)),
    case("range-f32", Op.RANGE, _scalars("float32", 0.5, 3.0, 0.25)),
    case("range-f64-neg", Op.RANGE, _scalars("float64", 1.0, -2.0, -0.3)),
    case("range-f16", Op.RANGE, _scalars("float16", 0.0, 2.0, 0.5)),
    case("range-empty", Op.RANGE, _scalars("int64", 5, 5, 1)),
    case("range-empty-wrong-way", Op.RANGE, _scalars("float32", 0.0, 3.0, -1.0)),
]

EYE_LIKE = [
    case("eye_like-square", Op.EYE_LIKE, data((4, 4))),
    case("eye_like-k-pos-int64", Op.EYE_LIKE, data((3, 5), "int64"), k=2),
    case("eye_like-k-neg-dtype", Op.EYE_LIKE, data((5, 3), "float32"), k=-1, dtype="float16"),
    case("eye_like-k-out", Op.EYE_LIKE, data((2, 3)), k=7),
    case("eye_like-empty", Op.EYE_LIKE, data((0, 3), "bool")),
]

TRILU = [
    *[case(f"trilu-upper-{dt}", Op.TRILU, data((4, 5), dt)) for dt in DTYPES],
    case("trilu-lower-k-input", Op.TRILU, data((3, 4, 4), "float32", i64(-1)), upper=0),
    case("trilu-upper-k-attr", Op.TRILU, data((2, 3, 5), "int64"), k=2),
    case("trilu-k-past-end", Op.TRILU, data((3, 3), "float32", i64(5))),
    case("trilu-empty", Op.TRILU, data((0, 3, 3))),
    case("trilu-nc", Op.TRILU, data((5, 4), view=transposed), upper=0),
]

CASES: list[OpCase] = [
    *RESHAPE, *EXPAND_DIMS, *SQUEEZE, *TRANSPOSE, *FLATTEN, *EXPAND, *SHAPE, *SIZE, *CONCAT,
    *SPLIT, *TILE, *PAD, *DEPTH_TO_SPACE, *SPACE_TO_DEPTH, *CONSTANT_OF_SHAPE, *RANGE,
    *EYE_LIKE, *TRILU,
]
