"""keel on a local Ray (one session for the module): >= 10,000 rows scored in actors equal
single-process prediction, in numpy, pandas and pyarrow batch formats."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np
import pandas as pd
import pyarrow as pa
import pytest
import ray

import keel
from keel.integrations.ray import KeelPredictor, backend_for

from .conftest import DIGITS, in_fixed_batch, same_answer

ROWS = 10_240
EXEC = 256


@pytest.fixture(scope="module")
def ray_session() -> Iterator[None]:
    # num_gpus=1 is a logical resource: it lets a test ask for a GPU actor anywhere.
    ray.init(num_cpus=2, num_gpus=1, include_dashboard=False, log_to_driver=False,
             configure_logging=False)
    # Rows come back in the dataset's order (Ray Data may otherwise yield blocks as they
    # finish), so they can be compared with one process's prediction row by row.
    ray.data.DataContext.get_current().execution_options.preserve_order = True
    yield
    ray.shutdown()


@pytest.fixture(scope="module")
def data() -> tuple[np.ndarray, np.ndarray]:
    x = np.random.default_rng(7).standard_normal((ROWS, 64)).astype(np.float32)
    expected = in_fixed_batch(keel.load_model(str(DIGITS)), x, EXEC)["probabilities"]
    return x, expected


def _score(ds: Any, fmt: str) -> Any:
    return ds.map_batches(KeelPredictor, fn_constructor_kwargs={
        "model": str(DIGITS), "execution_batch": EXEC, "inputs": {"pixels": "data"}},
        batch_size=1000, concurrency=2, batch_format=fmt)


def test_ray_scores_ten_thousand_rows_like_one_process(ray_session: None,
                                                       data: tuple[np.ndarray, np.ndarray]
                                                       ) -> None:
    x, expected = data
    scored = _score(ray.data.from_numpy(np.array_split(x, 4)), "numpy")
    got = np.concatenate([b["probabilities"] for b in scored.iter_batches(batch_size=None)])
    assert got.shape == (ROWS, 10)
    assert same_answer(got, expected)
    plain = keel.load_model(str(DIGITS)).predict({"pixels": x})["probabilities"]
    np.testing.assert_allclose(got, plain, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("fmt", ["pandas", "pyarrow"])
def test_pandas_and_pyarrow_batches(ray_session: None, data: tuple[np.ndarray, np.ndarray],
                                    fmt: str) -> None:
    x, expected = data
    n = 2000
    scored = _score(ray.data.from_numpy(x[:n]), fmt).to_pandas()
    assert list(scored.columns) == ["probabilities"]
    assert same_answer(np.stack(scored["probabilities"].to_numpy()), expected[:n])


def test_batch_formats_without_ray(data: tuple[np.ndarray, np.ndarray]) -> None:
    x, expected = data
    predictor = KeelPredictor(str(DIGITS), execution_batch=EXEC)
    rows = x[:300]
    for batch in ({"pixels": rows}, pd.DataFrame({"pixels": list(rows)}),
                  pa.table({"pixels": pa.array(list(rows))})):
        out = predictor(batch)
        assert type(out) is type(batch)
        column = out.column("probabilities").to_pylist() if isinstance(out, pa.Table) \
            else list(out["probabilities"])
        got = np.stack(column)
        assert same_answer(got.astype(np.float32), expected[:300])
    with pytest.raises(keel.InvalidArgumentError,
                       match="no column 'image' for model input 'pixels'"):
        KeelPredictor(str(DIGITS), inputs={"pixels": "image"})({"data": rows})


def test_num_gpus_puts_actors_on_the_gpu_backend(ray_session: None) -> None:
    assert backend_for("auto", ["0"]) == "gpu" and backend_for("auto", []) == "auto"
    assert backend_for("cpu", ["0"]) == "cpu"

    @ray.remote(num_gpus=1)
    def backend_in_a_gpu_task() -> str:
        try:
            return KeelPredictor(str(DIGITS)).model.backend
        except keel.BackendSelectionError as exc:      # no GPU behind Ray's logical one
            return f"refused: {exc}"

    answer = ray.get(backend_in_a_gpu_task.remote())
    assert answer == "gpu" or answer.startswith("refused: [BACKEND_SELECTION] backend 'gpu'")
