"""What dynamic batching relies on: inside one execution batch shape, a row's result is
bitwise independent of its position and of the other rows (keel's cpu kernels)."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

import keel
from keel.serving.batching import pad_rows
from keel.testing.models import lenet, mlp, resnet_block

B = 8


@pytest.mark.parametrize(("build", "shape"), [(mlp, (64,)), (lenet, (1, 28, 28)),
                                              (resnet_block, (3, 16, 16))])
def test_a_rows_answer_does_not_depend_on_its_neighbours(build: Any, shape: tuple[int, ...]
                                                         ) -> None:
    model = keel.load_model(build(), backend="cpu")
    name = model.inputs[0].name
    rng = np.random.default_rng(3)
    rows = rng.standard_normal((B, *shape)).astype(np.float32)
    together = model.predict({name: rows})
    for p in (0, 3, B - 1):
        alone = model.predict(pad_rows({name: rows[p:p + 1]}, B))       # row p at position 0
        other = rng.standard_normal((B, *shape)).astype(np.float32)
        other[B - 1 - p] = rows[p]                                       # elsewhere, new company
        moved = model.predict({name: other})
        for k, v in together.items():
            assert np.array_equal(alone[k][0], v[p])
            assert np.array_equal(moved[k][B - 1 - p], v[p])


def test_pad_rows_repeats_the_last_row() -> None:
    a = np.arange(6, dtype=np.float32).reshape(3, 2)
    padded = pad_rows({"a": a}, 5)["a"]
    assert padded.shape == (5, 2) and np.array_equal(padded[3:], [[4, 5], [4, 5]])
    assert pad_rows({"a": a}, 3)["a"] is a
