"""Conformance cases of the indexing family.

Indices are generated in range (negative ones included); scatter cases with
reduction "none" use distinct indices, since ONNX leaves duplicate writes
undefined. Cases named ``*-nc`` feed a non-contiguous input, ``*-empty`` a
zero-size one.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np

from keel.ops.registry import Op
from tests.conformance.cases_shape import DTYPES, Gen, Make, case, data, i64, rand, transposed
from tests.conformance.harness import OpCase


def idx(rng: Gen, shape: Sequence[int], size: int, dtype: str = "int64") -> np.ndarray:
    """Random indices in [-size, size)."""
    return rng.integers(-size, size, size=tuple(shape)).astype(dtype)


def with_indices(shape: Sequence[int], dtype: str, index_shape: Sequence[int], size: int,
                 index_dtype: str = "int64", view: Callable[[np.ndarray], np.ndarray] | None = None,
                 ) -> Make:
    def make(rng: Gen) -> list[np.ndarray | None]:
        x = rand(rng, shape, dtype)
        return [x if view is None else view(x), idx(rng, index_shape, size, index_dtype)]
    return make


INDEX = [
    *[case(f"index-{dt}", Op.INDEX, data((3, 4), dt), index=1) for dt in DTYPES],
    case("index-negative", Op.INDEX, data((3, 4, 2)), index=-1),
    case("index-axis", Op.INDEX, data((3, 4, 2), "int64"), index=2, axis=-2),
    case("index-empty-rest", Op.INDEX, data((2, 0)), index=0),
    case("index-1d", Op.INDEX, data((5,), "float16"), index=3),
    case("index-nc", Op.INDEX, data((4, 3), view=transposed), index=2, axis=1),
]

SLICE = [
    *[case(f"slice-basic-{dt}", Op.SLICE, data((5, 6), dt, i64(1, 0), i64(4, -1)))
      for dt in DTYPES],
    case("slice-axes-steps", Op.SLICE, data((5, 6, 4), "float32", i64(0, 1), i64(6, 100),
                                            i64(1, -1), i64(2, 2))),
    case("slice-negative-step", Op.SLICE, data((8, 3), "int64", i64(-1), i64(-9), i64(0),
                                               i64(-3))),
    case("slice-clamp-int64-max", Op.SLICE, data((4, 3), "float32", i64(-100),
                                                 i64(2**63 - 1), i64(1))),
    case("slice-reverse-all", Op.SLICE, data((6,), "float32", i64(2**63 - 1), i64(-2**63),
                                             i64(0), i64(-1))),
    case("slice-empty-result", Op.SLICE, data((5, 3), "float32", i64(3), i64(1))),
    case("slice-attrs", Op.SLICE, data((5, 6)), starts=(1,), ends=(-1,), axes=(-1,), steps=(2,)),
    case("slice-zero-size", Op.SLICE, data((0, 4), "float32", i64(1), i64(3), i64(1))),
    case("slice-nc", Op.SLICE, data((6, 5), "float64", i64(1, 0), i64(5, 4), view=transposed)),
]

GATHER = [
    *[case(f"gather-axis0-{dt}", Op.GATHER, with_indices((5, 3), dt, (2, 2), 5))
      for dt in DTYPES],
    case("gather-axis1-int32-idx", Op.GATHER, with_indices((3, 4, 2), "float32", (5,), 4,
                                                           "int32"), axis=1),
    case("gather-axis-neg", Op.GATHER, with_indices((3, 4), "int64", (2, 3), 4), axis=-1),
    case("gather-scalar-index", Op.GATHER, data((4, 3), "float32", np.array(-2, np.int64))),
    case("gather-empty-indices", Op.GATHER, data((4, 3), "float32",
                                                 np.zeros((0,), np.int64))),
    case("gather-empty-data", Op.GATHER, with_indices((3, 0), "float32", (2,), 3)),
    case("gather-nc", Op.GATHER, with_indices((5, 4), "float16", (3,), 5, view=transposed),
         axis=1),
]

GATHER_ELEMENTS = [
    *[case(f"gather_elements-axis0-{dt}", Op.GATHER_ELEMENTS,
           with_indices((4, 3), dt, (2, 3), 4)) for dt in ("float32", "int64", "bool")],
    case("gather_elements-axis1", Op.GATHER_ELEMENTS, with_indices((3, 5), "float32", (3, 7), 5),
         axis=1),
    case("gather_elements-smaller", Op.GATHER_ELEMENTS,
         with_indices((4, 5, 3), "float64", (2, 6, 2), 5, "int32"), axis=-2),
    case("gather_elements-empty", Op.GATHER_ELEMENTS, with_indices((3, 4), "float32", (0, 4), 3)),
    case("gather_elements-nc", Op.GATHER_ELEMENTS,
         with_indices((4, 3), "float32", (3, 3), 3, view=transposed), axis=0),
]


def _nd(shape: Sequence[int], dtype: str, batch: Sequence[int], k: int,
        sizes: Sequence[int]) -> Make:
    """GatherND inputs: index tuples of depth k over ``sizes``, under ``batch`` dims."""
    def make(rng: Gen) -> list[np.ndarray | None]:
        x = rand(rng, shape, dtype)
        cols = [idx(rng, (*batch, 1), n) for n in sizes[:k]]
        return [x, np.concatenate(cols, axis=-1)]
    return make


GATHER_ND = [
    case("gather_nd-k2-f32", Op.GATHER_ND, _nd((3, 4, 2), "float32", (5,), 2, (3, 4))),
    case("gather_nd-k1-int64", Op.GATHER_ND, _nd((3, 4), "int64", (2, 2), 1, (3,))),
    case("gather_nd-full-bool", Op.GATHER_ND, _nd((3, 4), "bool", (6,), 2, (3, 4))),
    case("gather_nd-batch1", Op.GATHER_ND, _nd((2, 3, 4), "float32", (2, 5), 1, (3,)),
         batch_dims=1),
    case("gather_nd-batch2-f16", Op.GATHER_ND,
         lambda rng: [rand(rng, (2, 3, 4, 2), "float16"),
                      idx(rng, (2, 3, 2, 1), 4)], batch_dims=2),
    case("gather_nd-empty", Op.GATHER_ND, _nd((3, 4), "float32", (0,), 2, (3, 4))),
]


def _scatter_elements(shape: Sequence[int], dtype: str, axis: int, index_shape: Sequence[int],
                      distinct: bool, nc: bool = False) -> Make:
    def make(rng: Gen) -> list[np.ndarray | None]:
        x = rand(rng, shape, dtype)
        size = shape[axis]
        if distinct:
            lanes = np.moveaxis(np.zeros(index_shape, np.int64), axis, -1)
            for pos in np.ndindex(*lanes.shape[:-1]):
                lanes[pos] = rng.permutation(size)[: lanes.shape[-1]] - size * (pos[0] % 2)
            indices = np.moveaxis(lanes, -1, axis)
        else:
            indices = idx(rng, index_shape, size)
        return [x.T.copy().T if nc else x, indices, rand(rng, index_shape, dtype)]
    return make


SCATTER_ELEMENTS = [
    *[case(f"scatter_elements-none-{dt}", Op.SCATTER_ELEMENTS,
           _scatter_elements((5, 3), dt, 0, (3, 3), True)) for dt in DTYPES],
    case("scatter_elements-axis1-neg", Op.SCATTER_ELEMENTS,
         _scatter_elements((3, 6), "float32", 1, (2, 4), True), axis=-1),
    *[case(f"scatter_elements-{red}-{dt}", Op.SCATTER_ELEMENTS,
           _scatter_elements((4, 3), dt, 0, (6, 3), False), reduction=red)
      for red in ("add", "mul", "max", "min") for dt in ("float32", "int64")],
    case("scatter_elements-add-f64", Op.SCATTER_ELEMENTS,
         _scatter_elements((4, 3), "float64", 1, (4, 5), False), axis=1, reduction="add"),
    case("scatter_elements-empty", Op.SCATTER_ELEMENTS,
         _scatter_elements((4, 3), "float32", 0, (0, 3), False)),
    case("scatter_elements-nc", Op.SCATTER_ELEMENTS,
         _scatter_elements((5, 4), "float32", 0, (2, 4), True, nc=True)),
]


def _scatter_nd(shape: Sequence[int], dtype: str, k: int, n: int, distinct: bool) -> Make:
    def make(rng: Gen) -> list[np.ndarray | None]:
        x = rand(rng, shape, dtype)
        if distinct:
            flat = rng.permutation(int(np.prod(shape[:k])))[:n]
            indices = np.stack(np.unravel_index(flat, tuple(shape[:k])), axis=-1)
            indices = indices - np.array(shape[:k]) * (rng.random(indices.shape) < 0.3)
        else:
            indices = np.stack([rng.integers(-d, d, size=n) for d in shape[:k]], axis=-1)
        updates = rand(rng, (n, *shape[k:]), dtype)
        return [x, indices.astype(np.int64), updates]
    return make


SCATTER_ND = [
    *[case(f"scatter_nd-none-{dt}", Op.SCATTER_ND, _scatter_nd((4, 5), dt, 2, 6, True))
      for dt in DTYPES],
    case("scatter_nd-rows", Op.SCATTER_ND, _scatter_nd((5, 3, 2), "float32", 1, 3, True)),
    *[case(f"scatter_nd-{red}-{dt}", Op.SCATTER_ND, _scatter_nd((4, 3), dt, 1, 6, False),
           reduction=red) for red in ("add", "mul", "max", "min")
      for dt in ("float32", "int64")],
    case("scatter_nd-empty-updates", Op.SCATTER_ND, _scatter_nd((4, 3), "float32", 2, 0, True)),
]


def _topk(shape: Sequence[int], dtype: str, k: int, ties: bool = False,
          nc: bool = False) -> Make:
    def make(rng: Gen) -> list[np.ndarray | None]:
        x = rng.integers(0, 4, size=tuple(shape)).astype(dtype) if ties else rand(rng, shape,
                                                                                    dtype)
        return [x.T if nc else x, i64(k)]
    return make


TOPK = [
    *[case(f"topk-{dt}", Op.TOPK, _topk((3, 7), dt, 3)) for dt in DTYPES if dt != "bool"],
    case("topk-smallest", Op.TOPK, _topk((3, 7), "float32", 4), largest=0),
    case("topk-ties-largest", Op.TOPK, _topk((4, 9), "int64", 5, ties=True)),
    case("topk-ties-smallest-f32", Op.TOPK, _topk((4, 9), "float32", 5, ties=True), largest=0),
    case("topk-axis0", Op.TOPK, _topk((6, 3), "float32", 2), axis=0),
    # k much smaller than the axis: the partition-based selection path.
    case("topk-select-ties", Op.TOPK, _topk((4, 40), "int64", 5, ties=True)),
    case("topk-select-ties-smallest-f16", Op.TOPK, _topk((3, 48), "float16", 6, ties=True),
         largest=0),
    case("topk-select-f32-axis0", Op.TOPK, _topk((64, 3), "float32", 3), axis=0),
    case("topk-k0", Op.TOPK, _topk((3, 4), "float32", 0)),
    case("topk-k-all", Op.TOPK, _topk((2, 5), "float64", 5)),
    case("topk-attr-k", Op.TOPK, data((3, 6)), k=2),
    case("topk-empty-rows", Op.TOPK, _topk((0, 4), "float32", 2)),
    case("topk-nc", Op.TOPK, _topk((6, 3), "float32", 2, nc=True)),
]


def _sparse(shape: Sequence[int], dtype: str, nc: bool = False) -> Make:
    def make(rng: Gen) -> list[np.ndarray | None]:
        x = (rand(rng, shape, dtype) * (rng.random(tuple(shape)) < 0.4)).astype(dtype)
        return [x.T if nc else x]
    return make


NONZERO = [
    *[case(f"nonzero-{dt}", Op.NONZERO, _sparse((4, 5), dt)) for dt in DTYPES],
    case("nonzero-3d", Op.NONZERO, _sparse((2, 3, 4), "float32")),
    case("nonzero-empty", Op.NONZERO, _sparse((0, 3), "float32")),
    case("nonzero-nc", Op.NONZERO, _sparse((4, 3), "int64", nc=True)),
]


def _one_hot(shape: Sequence[int], depth: int, dtype: str, index_dtype: str = "int64") -> Make:
    def make(rng: Gen) -> list[np.ndarray | None]:
        indices = rng.integers(-depth - 2, depth + 2, size=tuple(shape)).astype(index_dtype)
        return [indices, np.array(depth, np.int64), np.array([2, 7], dtype=dtype)]
    return make


ONE_HOT = [
    case("one_hot-f32", Op.ONE_HOT, _one_hot((3, 4), 5, "float32")),
    case("one_hot-axis0-int64", Op.ONE_HOT, _one_hot((3, 4), 4, "int64"), axis=0),
    case("one_hot-axis1-f16", Op.ONE_HOT, _one_hot((2, 3), 3, "float16", "int32"), axis=1),
    case("one_hot-float-indices", Op.ONE_HOT, _one_hot((5,), 6, "float32", "float32")),
    case("one_hot-empty", Op.ONE_HOT, _one_hot((0, 2), 3, "float32")),
]


def _compress(shape: Sequence[int], dtype: str, length: int, nc: bool = False) -> Make:
    def make(rng: Gen) -> list[np.ndarray | None]:
        x = rand(rng, shape, dtype)
        return [x.T if nc else x, rng.random(length) < 0.5]
    return make


COMPRESS = [
    *[case(f"compress-axis0-{dt}", Op.COMPRESS, _compress((5, 3), dt, 5), axis=0)
      for dt in DTYPES],
    case("compress-flat", Op.COMPRESS, _compress((3, 4), "float32", 12)),
    case("compress-short", Op.COMPRESS, _compress((3, 6), "int64", 4), axis=-1),
    case("compress-empty", Op.COMPRESS, _compress((0, 3), "float32", 0), axis=0),
    case("compress-nc", Op.COMPRESS, _compress((4, 5), "float32", 4, nc=True), axis=1),
]


def _reverse(shape: Sequence[int], dtype: str, lens: Sequence[int], nc: bool = False) -> Make:
    def make(rng: Gen) -> list[np.ndarray | None]:
        x = rand(rng, shape, dtype)
        return [x.T if nc else x, np.array(lens, np.int64)]
    return make


REVERSE_SEQUENCE = [
    *[case(f"reverse_sequence-time0-{dt}", Op.REVERSE_SEQUENCE, _reverse((4, 3, 2), dt, (4, 1, 2)))
      for dt in ("float32", "int64", "bool")],
    case("reverse_sequence-batch0", Op.REVERSE_SEQUENCE, _reverse((3, 5), "float32", (5, 0, 3)),
         batch_axis=0, time_axis=1),
    case("reverse_sequence-empty-features", Op.REVERSE_SEQUENCE,
         _reverse((3, 2, 0), "float32", (3, 2))),
    case("reverse_sequence-nc", Op.REVERSE_SEQUENCE, _reverse((3, 4), "float16", (2, 3, 1),
                                                              nc=True),
         batch_axis=1, time_axis=0),
]


def _repeats(shape: Sequence[int], dtype: str, values: int) -> Make:
    def make(rng: Gen) -> list[np.ndarray | None]:
        return [rng.integers(0, values, size=tuple(shape)).astype(dtype)]
    return make


UNIQUE = [
    *[case(f"unique-sorted-{dt}", Op.UNIQUE, _repeats((12,), dt, 5))
      for dt in ("float32", "int64", "int32", "uint8", "bool", "float16")],
    case("unique-unsorted", Op.UNIQUE, _repeats((15,), "int64", 6), sorted=0),
    case("unique-flatten-2d", Op.UNIQUE, _repeats((3, 4), "float32", 4)),
    case("unique-axis0", Op.UNIQUE, _repeats((6, 2), "int64", 2), axis=0),
    case("unique-axis1-unsorted", Op.UNIQUE, _repeats((2, 6), "int64", 2), axis=-1, sorted=0),
    case("unique-empty", Op.UNIQUE, _repeats((0,), "float32", 3)),
]

CASES: list[OpCase] = [
    *INDEX, *SLICE, *GATHER, *GATHER_ELEMENTS, *GATHER_ND, *SCATTER_ELEMENTS, *SCATTER_ND,
    *TOPK, *NONZERO, *ONE_HOT, *COMPRESS, *REVERSE_SEQUENCE, *UNIQUE,
]
