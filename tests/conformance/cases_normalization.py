"""Conformance cases of the normalization family (softmax family included).

Each op runs in float32, float64 and float16 (the cpu kernels compute float16
in float32), over several ranks and axes, with zero-size inputs where the op
allows them (``*-empty``) and non-contiguous views (``*-nc``). Softmax cases
include large magnitudes (``*-large``: the max is subtracted first), more rows
than one block of the cpu kernels (``*-many-rows``) and Hardmax ties
(``*-ties``: the first maximum wins).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from keel.ops.registry import Op
from tests.conformance.harness import OpCase

Gen = np.random.Generator
Make = Callable[[Gen], list[np.ndarray | None]]
View = Callable[[np.ndarray], np.ndarray]

F16, F32, F64 = np.float16, np.float32, np.float64
_DTYPES = (F32, F64, F16)


def norm_tol(dtype: Any) -> dict[str, Any]:
    """float32 statistics are accumulated in float32 by the cpu kernels: allow for it."""
    dt = np.dtype(dtype)
    if dt == np.float16:
        return {"rtol": 5e-3, "atol": 5e-3}
    if dt == np.float64:
        return {"rtol": 1e-10, "atol": 1e-10}
    return {"rtol": 1e-4, "atol": 1e-5}


def _name(dtype: Any) -> str:
    return np.dtype(dtype).name


def _normal(rng: Gen, shape: Sequence[int], dtype: Any, scale: float = 1.0,
            shift: float = 0.0) -> np.ndarray:
    return (rng.standard_normal(tuple(shape)) * scale + shift).astype(dtype)


def _x(shape: Sequence[int], dtype: Any = F32, *params: Sequence[int],
       view: View | None = None, scale: float = 1.0, shift: float = 0.0,
       positive: Sequence[int] = ()) -> Make:
    """X of ``shape`` (seen through ``view``) and one random parameter per ``params`` shape;
    parameters whose index is in ``positive`` are made positive (variances)."""
    def make(rng: Gen) -> list[np.ndarray | None]:
        x = _normal(rng, shape, dtype, scale, shift)
        ps: list[np.ndarray | None] = []
        for i, p in enumerate(params):
            v = _normal(rng, p, dtype)
            ps.append(np.abs(v) + 0.1 if i in positive else v)
        return [x if view is None else view(x), *ps]
    return make


def _batch_norm() -> list[OpCase]:
    op = Op.BATCH_NORM
    c4 = [(4,)] * 4
    cases = [OpCase(f"batch_norm-nchw-{_name(dt)}", op,
                    _x((2, 4, 3, 5), dt, *c4, positive=(3,)), **norm_tol(dt)) for dt in _DTYPES]
    cases += [
        OpCase("batch_norm-nc", op, _x((6, 4), F32, *c4, positive=(3,)), **norm_tol(F32)),
        OpCase("batch_norm-ncd", op, _x((2, 4, 7), F32, *c4, positive=(3,)),
               {"epsilon": 1e-3}, **norm_tol(F32)),
        OpCase("batch_norm-5d", op, _x((1, 4, 2, 3, 2), F32, *c4, positive=(3,)), **norm_tol(F32)),
        OpCase("batch_norm-empty", op, _x((0, 4, 3), F32, *c4, positive=(3,)), **norm_tol(F32)),
        OpCase("batch_norm-nc-view", op, _x((2, 5, 3, 4), F32, *c4, positive=(3,),
                                            view=lambda x: x.transpose(0, 3, 2, 1)),
               **norm_tol(F32)),
    ]
    return cases


def _layer_norm() -> list[OpCase]:
    op = Op.LAYER_NORM
    cases = [OpCase(f"layer_norm-last-{_name(dt)}", op, _x((3, 5, 16), dt, (16,), (16,)),
                    **norm_tol(dt)) for dt in _DTYPES]
    cases += [
        OpCase("layer_norm-axis1", op, _x((3, 4, 5), F32, (4, 5), (4, 5)), {"axis": 1},
               **norm_tol(F32)),
        OpCase("layer_norm-axis0", op, _x((3, 4), F32, (3, 4)), {"axis": 0}, **norm_tol(F32)),
        OpCase("layer_norm-no-bias", op, _x((2, 8), F32, (8,)), **norm_tol(F32)),
        OpCase("layer_norm-broadcast-scale", op, _x((2, 3, 6), F32, (1, 1, 6), (1, 6)),
               {"axis": -2}, **norm_tol(F32)),
        OpCase("layer_norm-shifted", op, _x((4, 32), F32, (32,), (32,), shift=50.0),
               **norm_tol(F32)),
        OpCase("layer_norm-stash11", op, _x((2, 6), F32, (6,), (6,)),
               {"stash_type": 11, "epsilon": 1e-3}, **norm_tol(F64)),
        OpCase("layer_norm-empty", op, _x((0, 5), F32, (5,), (5,)), **norm_tol(F32)),
        OpCase("layer_norm-nc", op, _x((6, 3, 4), F32, (6,), (6,),
                                       view=lambda x: x.transpose(2, 1, 0)), **norm_tol(F32)),
        # More rows than one block of the cpu kernel (it works on ~64 Ki elements at a time).
        OpCase("layer_norm-many-rows", op, _x((4, 300, 96), F32, (96,), (96,), scale=2.0),
               **norm_tol(F32)),
    ]
    return cases


def _instance_group_rms() -> list[OpCase]:
    cases = [OpCase(f"instance_norm-{_name(dt)}", Op.INSTANCE_NORM,
                    _x((2, 3, 4, 5), dt, (3,), (3,)), **norm_tol(dt)) for dt in _DTYPES]
    cases += [
        OpCase("instance_norm-3d", Op.INSTANCE_NORM, _x((2, 3, 7), F32, (3,), (3,)),
               {"epsilon": 1e-2}, **norm_tol(F32)),
        OpCase("instance_norm-empty", Op.INSTANCE_NORM, _x((0, 3, 4), F32, (3,), (3,)),
               **norm_tol(F32)),
        OpCase("instance_norm-nc", Op.INSTANCE_NORM,
               _x((5, 4, 3, 2), F32, (3,), (3,), view=lambda x: x.transpose(3, 2, 1, 0)),
               **norm_tol(F32)),
    ]
    cases += [OpCase(f"group_norm-{_name(dt)}", Op.GROUP_NORM,
                     _x((2, 6, 3, 4), dt, (6,), (6,)), {"num_groups": 3}, **norm_tol(dt))
              for dt in _DTYPES]
    cases += [
        OpCase(f"group_norm-groups{g}", Op.GROUP_NORM, _x((2, 4, 5), F32, (4,), (4,)),
               {"num_groups": g}, **norm_tol(F32)) for g in (1, 4)
    ]
    cases += [
        OpCase("group_norm-per-group-scale", Op.GROUP_NORM, _x((2, 6, 5), F32, (2,), (2,)),
               {"num_groups": 2}, **norm_tol(F32)),
        OpCase("group_norm-empty", Op.GROUP_NORM, _x((0, 4, 3), F32, (4,), (4,)),
               {"num_groups": 2}, **norm_tol(F32)),
        OpCase("group_norm-nc", Op.GROUP_NORM,
               _x((6, 3, 4), F32, (4,), (4,), view=lambda x: x.transpose(1, 2, 0)),
               {"num_groups": 2}, **norm_tol(F32)),
    ]
    cases += [OpCase(f"rms_norm-{_name(dt)}", Op.RMS_NORM, _x((3, 4, 8), dt, (8,)), **norm_tol(dt))
              for dt in _DTYPES]
    cases += [
        OpCase("rms_norm-axis1", Op.RMS_NORM, _x((3, 4, 5), F32, (4, 5)), {"axis": 1},
               **norm_tol(F32)),
        OpCase("rms_norm-empty", Op.RMS_NORM, _x((0, 4), F32, (4,)), **norm_tol(F32)),
        OpCase("rms_norm-nc", Op.RMS_NORM, _x((8, 3), F32, (8,), view=lambda x: x.T),
               **norm_tol(F32)),
    ]
    return cases


def _lrn_lp_mvn() -> list[OpCase]:
    cases = [OpCase(f"lrn-size{size}-{_name(dt)}", Op.LRN, _x((2, 6, 3, 3), dt),
                    {"size": size, "alpha": 1e-2, "beta": 0.6, "bias": 2.0}, **norm_tol(dt))
             for size in (1, 3, 4) for dt in _DTYPES]
    cases += [
        OpCase("lrn-3d", Op.LRN, _x((2, 5, 7), F32), {"size": 5}, **norm_tol(F32)),
        OpCase("lrn-empty", Op.LRN, _x((0, 4, 2, 2), F32), {"size": 3}, **norm_tol(F32)),
        OpCase("lrn-nc", Op.LRN, _x((3, 3, 4, 2), F32, view=lambda x: x.transpose(3, 2, 1, 0)),
               {"size": 3, "alpha": 0.1}, **norm_tol(F32)),
    ]
    cases += [OpCase(f"lp_normalization-p{p}-{_name(dt)}", Op.LP_NORMALIZATION,
                     _x((3, 4, 5), dt), {"p": p, "axis": ax}, **norm_tol(dt))
              for p, ax in ((1, 1), (2, -1)) for dt in _DTYPES]
    cases += [
        OpCase("lp_normalization-zero-rows", Op.LP_NORMALIZATION,
               lambda rng: [np.array([[0.0, 0.0, 0.0], [3.0, -4.0, 0.0]], dtype=F32)]),
        OpCase("lp_normalization-empty", Op.LP_NORMALIZATION, _x((0, 3), F32), {"axis": 0}),
        OpCase("lp_normalization-nc", Op.LP_NORMALIZATION, _x((5, 4), F32, view=lambda x: x.T),
               {"p": 1}, **norm_tol(F32)),
    ]
    cases += [OpCase(f"mean_variance_norm-{_name(dt)}", Op.MEAN_VARIANCE_NORM,
                     _x((2, 3, 4, 5), dt, scale=2.0, shift=1.0), **norm_tol(dt)) for dt in _DTYPES]
    cases += [
        OpCase("mean_variance_norm-last", Op.MEAN_VARIANCE_NORM, _x((3, 7), F32),
               {"axes": (-1,)}, **norm_tol(F32)),
        OpCase("mean_variance_norm-empty", Op.MEAN_VARIANCE_NORM, _x((2, 0, 3, 3), F32),
               **norm_tol(F32)),
        OpCase("mean_variance_norm-nc", Op.MEAN_VARIANCE_NORM,
               _x((4, 3, 2, 5), F32, view=lambda x: x.transpose(1, 0, 2, 3)),
               {"axes": (0, 1)}, **norm_tol(F32)),
    ]
    return cases


def _softmax_family() -> list[OpCase]:
    cases: list[OpCase] = []
    for op in (Op.SOFTMAX, Op.LOG_SOFTMAX, Op.HARDMAX):
        name = op.value
        cases += [OpCase(f"{name}-{_name(dt)}", op, _x((3, 4, 5), dt), **norm_tol(dt))
                  for dt in _DTYPES]
        cases += [
            OpCase(f"{name}-axis{ax}", op, _x((3, 4, 5), F32, scale=3.0), {"axis": ax},
                   **norm_tol(F32)) for ax in (0, 1, -2)
        ]
        cases += [
            OpCase(f"{name}-1d", op, _x((17,), F32), **norm_tol(F32)),
            OpCase(f"{name}-large", op, _x((4, 9), F32, scale=300.0, shift=1000.0),
                   **norm_tol(F32)),
            OpCase(f"{name}-empty", op, _x((0, 3), F32), {"axis": 1}),
            OpCase(f"{name}-empty-axis", op, _x((3, 0), F32), {"axis": 1}),
            OpCase(f"{name}-nc", op, _x((6, 4, 3), F32, view=lambda x: x.transpose(2, 0, 1)),
                   {"axis": 1}, **norm_tol(F32)),
            # Several blocks of rows, in scaled-attention style (wide spread per block).
            OpCase(f"{name}-many-rows", op, _x((2, 4, 128, 130), F32, scale=30.0),
                   **norm_tol(F32)),
        ]
    cases.append(OpCase("hardmax-ties", Op.HARDMAX,
                        lambda rng: [rng.integers(0, 3, (5, 6)).astype(F32)], {"axis": 1}))
    return cases


CASES: list[OpCase] = [
    *_batch_norm(),
    *_layer_norm(),
    *_instance_group_rms(),
    *_lrn_lp_mvn(),
    *_softmax_family(),
]
