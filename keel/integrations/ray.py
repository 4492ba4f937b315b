"""keel on Ray Data: a callable class for ``Dataset.map_batches``.

    import ray
    from keel.integrations.ray import KeelPredictor

    ds = ray.data.read_parquet("features.parquet")
    scored = ds.map_batches(KeelPredictor, fn_constructor_kwargs={"model": "model.onnx"},
                            concurrency=4, batch_size=1024)

Each actor loads the model once. Batches may come as NumPy dicts, pandas
DataFrames or pyarrow Tables; the answer comes back in the same format with
one column per model output, named after it. An actor given GPUs by Ray
(``num_gpus=``) runs on keel's ``gpu`` backend. Each row's answer is bitwise the
same however Ray cut the dataset into batches: by itself where the model's plan is
batch invariant (keel's cpu backend, docs/runtime.md), else with
``execution_batch=N``, which then runs every batch in chunks of exactly ``N`` rows
(the last one padded).
Ray itself is imported only here (``pip install "keel-runtime[ray]"``).

:func:`serve_app` builds a Ray Serve application that answers the Open Inference
Protocol's REST infer request (JSON or binary tensors, as ``keel serve`` does) with
Serve batching the requests of one replica::

    from ray import serve
    from keel.integrations.ray import serve_app

    serve.run(serve_app("model.onnx", max_batch_size=8), route_prefix="/model")
    # POST http://127.0.0.1:8000/model  {"inputs": [{"name": ..., "shape": ..., ...}]}
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from keel.errors import InvalidArgumentError, KeelError
from keel.inference_protocol import Limits

__all__ = ["KeelPredictor", "backend_for", "serve_app"]


def backend_for(backend: str, gpu_ids: Sequence[Any]) -> str:
    """The backend an actor runs on: ``gpu`` when Ray gave it GPUs and none was named."""
    if backend == "auto" and len(gpu_ids) > 0:
        return "gpu"
    return backend


class KeelPredictor:
    """Scores batches with one keel model loaded once per Ray actor.

    ``inputs`` maps a model input to the batch column that feeds it (default: the
    columns named like the inputs; a one-input model takes a batch's only column).
    ``load_options`` go to :func:`keel.load_model`.
    """

    def __init__(self, model: Any, *, backend: str = "auto",
                 inputs: Mapping[str, str] | None = None,
                 execution_batch: int | None = None, **load_options: Any) -> None:
        from keel.execution.model import load_model

        try:
            import ray

            gpu_ids: Sequence[Any] = ray.get_gpu_ids() if ray.is_initialized() else []
        except ImportError:                       # used without Ray: plain keel
            gpu_ids = []
        if execution_batch is not None and execution_batch < 1:
            raise InvalidArgumentError(f"execution_batch must be at least 1, got "
                                       f"{execution_batch}")
        self.backend = backend_for(backend, gpu_ids)
        self.model = load_model(model, backend=self.backend, **load_options)
        self.inputs = dict(inputs or {})
        self.execution_batch = execution_batch
        self.padding_reason = ""            # why batches run padded ("" when they do not)
        if execution_batch is not None:
            from keel.serving.batching import batch_invariance

            invariant, why = batch_invariance(self.model)
            if invariant:                   # a row's answer never depends on its batch
                self.execution_batch = None
            else:
                self.padding_reason = why

    def __call__(self, batch: Any) -> Any:
        columns, kind = _columns(batch)
        feeds = self._feeds(columns)
        outputs = self._predict(feeds)
        return _as_kind(outputs, kind)

    def _feeds(self, columns: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        feeds = {}
        declared = self.model.inputs
        for info in declared:
            column = self.inputs.get(info.name, info.name)
            if column not in columns and len(declared) == 1 and len(columns) == 1 \
                    and info.name not in self.inputs:
                column = next(iter(columns))
            if column not in columns:
                raise InvalidArgumentError(
                    f"the batch has no column {column!r} for model input {info.name!r}; its "
                    f"columns are: {', '.join(columns)} (map them with inputs={{...}})")
            feeds[info.name] = np.asarray(columns[column], dtype=info.dtype.numpy)
        return feeds

    def _predict(self, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        size = self.execution_batch
        if size is None:
            return dict(self.model.predict(feeds))
        from keel.serving.batching import pad_rows

        rows = len(next(iter(feeds.values())))
        parts = []
        for start in range(0, rows, size):
            chunk = {k: v[start:start + size] for k, v in feeds.items()}
            n = len(next(iter(chunk.values())))
            out = self.model.predict(pad_rows(chunk, size))
            parts.append({k: v[:n] for k, v in out.items()})
        return {k: np.concatenate([p[k] for p in parts]) for k in parts[0]}


def _columns(batch: Any) -> tuple[dict[str, np.ndarray], str]:
    """The batch's columns as arrays (rows first), and its format."""
    if isinstance(batch, Mapping):
        return {k: _stack(v) for k, v in batch.items()}, "numpy"
    module = type(batch).__module__.split(".")[0]
    if module == "pandas":
        return {str(k): _stack(batch[k].to_numpy()) for k in batch.columns}, "pandas"
    if module == "pyarrow":
        return {name: _arrow_column(batch.column(name)) for name in batch.column_names}, \
            "pyarrow"
    raise InvalidArgumentError(f"a batch must be a dict of arrays, a pandas DataFrame or a "
                               f"pyarrow Table, got {type(batch).__name__}")


def _stack(values: Any) -> np.ndarray:
    array = np.asarray(values)
    if array.dtype == object and len(array) and isinstance(array[0], np.ndarray | list):
        return np.stack([np.asarray(v) for v in array])
    return array


def _arrow_column(column: Any) -> np.ndarray:
    chunked = column.combine_chunks() if hasattr(column, "combine_chunks") else column
    to_numpy = getattr(chunked, "to_numpy", None)
    if hasattr(chunked.type, "storage_type") and to_numpy is not None:    # Ray's tensor type
        return np.asarray(to_numpy())
    return _stack(chunked.to_numpy(zero_copy_only=False))


def _as_kind(outputs: dict[str, np.ndarray], kind: str) -> Any:
    if kind == "numpy":
        return outputs
    if kind == "pandas":
        import pandas as pd

        return pd.DataFrame({k: list(v) if v.ndim > 1 else v for k, v in outputs.items()})
    import pyarrow as pa

    return pa.table({k: pa.array(list(v)) if v.ndim > 1 else pa.array(v)
                     for k, v in outputs.items()})


def serve_app(model: Any, *, max_batch_size: int = 8, batch_wait_timeout_s: float = 0.002,
              num_replicas: int = 1, ray_actor_options: Mapping[str, Any] | None = None,
              **predictor_options: Any) -> Any:
    """A Ray Serve application (``serve.run(serve_app(...))``) serving ``model``.

    Each replica loads the model once (a :class:`KeelPredictor`; ``num_gpus`` in
    ``ray_actor_options`` puts it on the ``gpu`` backend). Requests are the Open
    Inference Protocol's REST infer body, JSON or with binary tensors; Serve batches up
    to ``max_batch_size`` requests of one replica, and a row's answer is bitwise the same
    whatever else Serve batched with it: the batch runs as it is where the model's plan
    is batch invariant, else in chunks of exactly ``execution_batch`` rows (default
    ``max_batch_size``, the last one padded). A bad request
    answers the protocol's error body with status 400.
    """
    from ray import serve

    if max_batch_size < 1:
        raise InvalidArgumentError(f"max_batch_size must be at least 1, got {max_batch_size}")
    options = {"execution_batch": max_batch_size, **predictor_options}

    @serve.deployment(num_replicas=num_replicas, ray_actor_options=dict(ray_actor_options or {}))
    class KeelDeployment:
        def __init__(self) -> None:
            self.predictor = KeelPredictor(model, **options)

        @serve.batch(max_batch_size=max_batch_size, batch_wait_timeout_s=batch_wait_timeout_s)
        async def run(self, requests: list[dict[str, np.ndarray]]
                      ) -> list[dict[str, np.ndarray] | Exception]:
            return _run_batch(self.predictor, requests)

        async def __call__(self, request: Any) -> Any:
            from keel.serving.http import decode_request, encode_reply

            body = await request.body()
            try:
                header, arrays, wanted, binary = decode_request(
                    body, request.headers.get("inference-header-content-length"), _LIMITS)
                names = [i.name for i in self.predictor.model.inputs]
                unknown = sorted(set(arrays) - set(names))
                if unknown:
                    return _error_reply(f"unknown input {unknown[0]!r}; the model's inputs "
                                        f"are {', '.join(names)}")
                result = await self.run(self.predictor._feeds(arrays))
                if isinstance(result, Exception):
                    raise result
            except KeelError as exc:        # bad input, a shape the model refuses
                return _error_reply(str(exc))
            if wanted:
                unknown = sorted(set(wanted) - set(result))
                if unknown:
                    return _error_reply(f"unknown output {unknown[0]!r}")
                result = {k: v for k, v in result.items() if k in wanted}
            reply = {"model_name": str(model), "id": header.get("id", "")}
            return encode_reply(reply, result, wanted, binary)

    return KeelDeployment.bind()   # type: ignore[attr-defined]


def _run_batch(predictor: KeelPredictor, requests: list[dict[str, np.ndarray]]
               ) -> list[dict[str, np.ndarray] | Exception]:
    """The rows of requests whose inputs agree past the batch axis run together; each
    request gets its own rows back, or the error of its group alone."""
    answers: list[dict[str, np.ndarray] | Exception] = [
        InvalidArgumentError("every input of a request needs the same number of rows "
                             "(the batch axis first)")] * len(requests)
    groups: dict[tuple[Any, ...], list[int]] = {}
    for i, r in enumerate(requests):
        if _rows(r) is not None:
            groups.setdefault(tuple((k, v.shape[1:]) for k, v in sorted(r.items())),
                              []).append(i)
    for members in groups.values():
        try:
            outputs = predictor._predict({k: np.concatenate([requests[i][k] for i in members])
                                          for k in requests[members[0]]})
        except Exception as exc:          # the group's requests answer with it
            for i in members:
                answers[i] = exc
            continue
        start = 0
        for i in members:
            n = _rows(requests[i]) or 0
            answers[i] = {k: v[start:start + n] for k, v in outputs.items()}
            start += n
    return answers


def _rows(feeds: Mapping[str, np.ndarray]) -> int | None:
    counts = {a.shape[0] if a.ndim else -1 for a in feeds.values()}
    return counts.pop() if len(counts) == 1 and -1 not in counts else None


def _error_reply(message: str) -> Any:
    from starlette.responses import JSONResponse

    return JSONResponse({"error": message}, status_code=400)


_LIMITS = Limits()
