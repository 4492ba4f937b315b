"""The models a server holds: loading, versions, swapping, and one request's run.

A repository is one model file (``model.onnx`` or ``.keel``; its name is the
file's stem) or a folder holding ``NAME.onnx`` / ``NAME.keel`` files and
``NAME/<version>/model.onnx`` folders (the highest version is served). Loading a
model that is already served loads the repository's current version beside it
and then swaps: requests already running finish on the old one.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from keel.errors import KeelError
from keel.inference_protocol import ProtocolError, datatype_of, datatype_of_array, not_found
from keel.serving.batching import Batcher, batch_invariance, check_invariance, pad_rows

__all__ = ["ModelOptions", "Repository", "ServedModel", "load_served", "pad_rows", "run_request"]

_SUFFIXES = (".onnx", ".keel")


@dataclass(frozen=True)
class ModelOptions:
    """How the server loads and batches every model."""

    backend: str = "auto"
    max_batch_size: int = 8             # the execution batch size; 1: no dynamic batching
    max_queue_delay_s: float = 0.002
    hint: str = "none"                  # the models' performance hint: how the planner splits

    def __post_init__(self) -> None:
        from keel.planning.adaptive import check_hint

        object.__setattr__(self, "hint", check_hint(self.hint, "--hint"))


@dataclass
class ServedModel:
    """One loaded version of a model, with its batcher."""

    name: str
    version: str
    path: Path
    model: Any                            # keel.Model
    batch_size: int | None                # None: each request runs alone, as sent
    batch_reason: str                     # why batches are padded, or requests run alone
    padded: bool = True                   # batches run padded to batch_size (else as they are)
    split_note: str = ""                  # how the planner splits a full batch
    batcher: Batcher | None = None
    in_flight: int = 0
    idle: asyncio.Event = field(default_factory=asyncio.Event)

    @property
    def batching(self) -> str:
        """``exact`` (batches run as they are), ``padded`` (to ``batch_size`` rows) or
        ``alone`` (no dynamic batching)."""
        if self.batch_size is None:
            return "alone"
        return "padded" if self.padded else "exact"

    def batching_summary(self) -> str:
        """How requests run, and why: what the plan summary and model metadata say."""
        if self.batch_size is None:
            return f"no dynamic batching ({self.batch_reason})"
        if self.padded:
            return (f"dynamic batching padded to {self.batch_size} rows "
                    f"({self.batch_reason})")
        return (f"dynamic batching up to {self.batch_size} rows, unpadded "
                f"({self.batch_reason}); {self.split_note}")

    def metadata(self) -> dict[str, Any]:
        def tensors(infos: Sequence[Any]) -> list[dict[str, Any]]:
            return [{"name": t.name, "datatype": datatype_of(t.dtype),
                     "shape": [d if isinstance(d, int) else -1 for d in (t.shape or ())]}
                    for t in infos]

        return {"name": self.name, "versions": [self.version], "platform": "keel_onnx",
                "inputs": tensors(self.model.inputs), "outputs": tensors(self.model.outputs),
                "parameters": {"batching": self.batching,
                               "batching_reason": self.batching_summary()}}

    def plan_summary(self) -> str:
        plan = self.model.plan
        backends = sorted({n.backend for n in plan.nodes})
        batching = self.batching_summary()
        return (f"{self.name} v{self.version}: {len(plan.nodes)} nodes on "
                f"{', '.join(backends) or 'no backend'}, peak {plan.peak_bytes} bytes; "
                f"{batching}")

    def check_inputs(self, arrays: Mapping[str, np.ndarray]) -> None:
        """Names, dtypes and fixed dimensions against the model's declared inputs."""
        declared = {t.name: t for t in self.model.inputs}
        for name in arrays:
            if name not in declared:
                raise ProtocolError(f"model {self.name!r} has no input {name!r}; its inputs "
                                    f"are: {', '.join(declared)}")
        for name, info in declared.items():
            if name not in arrays:
                raise ProtocolError(f"model {self.name!r}: input {name!r} is missing")
            a = arrays[name]
            want = datatype_of(info.dtype)
            got = datatype_of_array(a)
            if got != want:
                raise ProtocolError(f"model {self.name!r}: input {name!r} is {want}, "
                                    f"got {got}")
            shape = info.shape
            if shape is not None and (len(shape) != a.ndim or any(
                    isinstance(d, int) and d != n for d, n in zip(shape, a.shape, strict=True))):
                dims = [d if isinstance(d, int) else -1 for d in shape]
                raise ProtocolError(f"model {self.name!r}: input {name!r} has shape "
                                    f"{list(a.shape)}, the model takes {dims} (-1: any)")
        if self.batch_size is not None:
            rows = {a.shape[0] for a in arrays.values()}
            if len(rows) != 1 or 0 in rows:
                raise ProtocolError(f"model {self.name!r}: every input must hold the same, "
                                    f"non-zero number of rows; got {sorted(rows)}")

    async def infer(self, arrays: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        self.check_inputs(arrays)
        if self.batcher is not None:
            return await self.batcher.submit(arrays)
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(None, self.model.predict, arrays)

    async def close(self) -> None:
        """Wait for this version's requests, then stop its batcher."""
        while self.in_flight:
            self.idle.clear()
            await self.idle.wait()
        if self.batcher is not None:
            await self.batcher.close()


def load_served(name: str, version: str, path: Path, options: ModelOptions,
                observe: Callable[[str], Any] | None = None) -> ServedModel:
    """Load ``path`` and decide whether it can batch (runs on a worker thread)."""
    from keel.execution.model import load_model

    model = load_model(str(path), backend=options.backend, hint=options.hint)
    size, reason, padded = _batchable(model, options.max_batch_size)
    served = ServedModel(name, version, path, model, size, reason, padded)
    if size is not None and not padded:
        served.split_note = _split_note(model.adaptive_plan, size)
    served.idle.set()
    return served


def _batchable(model: Any, size: int) -> tuple[int | None, str, bool]:
    """The batch limit (None: requests run alone), why, and whether batches are padded."""
    if size < 2:
        return None, "max batch size below 2", True
    feeds = {}
    for info in model.inputs:
        shape = info.shape
        if not shape or isinstance(shape[0], int) or not all(
                isinstance(d, int) for d in shape[1:]):
            return (None, f"input {info.name!r} has no free first dimension with fixed others",
                    True)
        if info.dtype.value == "string":
            return None, f"input {info.name!r} holds strings", True
        feeds[info.name] = np.zeros((size, *shape[1:]), dtype=info.dtype.numpy)
    try:
        out = model.predict(feeds)
    except KeelError as exc:
        return None, f"a {size}-row warm-up run failed: {exc}", True
    wrong = [k for k, v in out.items() if v.ndim == 0 or v.shape[0] != size]
    if wrong:
        return (None, f"output {wrong[0]!r} does not have the batch as its first dimension",
                True)
    invariant, why = batch_invariance(model)
    if invariant:
        try:
            differs = check_invariance(model.predict, {k: _sample(a.shape, a.dtype)
                                                       for k, a in feeds.items()})
        except KeelError as exc:
            differs = f"that the rows it runs fail: {exc}"
        if differs:
            invariant, why = False, f"a check at load found {differs}"
    return size, why, not invariant


def _split_note(plan: Any, size: int) -> str:
    """What the model's adaptive planner does with a full batch (its last run was one)."""
    if plan is None or plan.size != size:
        return "the model's planner splits each batch"
    if plan.chunked:
        return (f"the planner runs a batch of {size} in chunks of {plan.chunk_size} "
                "(memory budget)")
    if plan.streams > 1:
        return (f"the planner runs a batch of {size} as "
                f"{'+'.join(map(str, plan.batch_split))} on {plan.streams} streams")
    return f"the planner runs a batch of {size} whole ({plan.hint} hint)"


def _sample(shape: tuple[int, ...], dtype: np.dtype[Any]) -> np.ndarray:
    """Rows that differ, so a batch check can tell them apart: random floats; 0 and 1 by
    row for integers and booleans (valid indices, ids and masks)."""
    if dtype.kind in "fc":
        return np.random.default_rng(0).standard_normal(shape).astype(dtype)
    rows = np.indices(shape)[0] % 2
    return rows.astype(dtype)


def batch_runner(served: ServedModel) -> Callable[[dict[str, np.ndarray]],
                                                  dict[str, np.ndarray]]:
    def run(arrays: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        return dict(served.model.predict(arrays))

    return run


class Repository:
    """The models of one file or folder, by name; what the server serves."""

    def __init__(self, root: str | Path, options: ModelOptions,
                 on_batch: Callable[[str, int, int, list[float], int], None] | None = None
                 ) -> None:
        self.root = Path(root)
        if not self.root.exists():
            raise not_found(f"model repository {str(self.root)!r} does not exist")
        self.options = options
        self._on_batch = on_batch
        self._served: dict[str, ServedModel] = {}
        self._failed: dict[str, str] = {}
        self._locks: dict[str, asyncio.Lock] = {}

    # ---- what is there -----------------------------------------------------
    def available(self) -> dict[str, tuple[str, Path]]:
        """Every model the repository holds: name -> (version, file)."""
        if self.root.is_file():
            return {self.root.stem: ("1", self.root)}
        found: dict[str, tuple[str, Path]] = {}
        for entry in sorted(self.root.iterdir()):
            if entry.is_file() and entry.suffix in _SUFFIXES:
                found[entry.stem] = ("1", entry)
            elif entry.is_dir():
                versions = sorted((int(v.name), v) for v in entry.iterdir()
                                  if v.is_dir() and v.name.isdigit())
                for number, folder in reversed(versions):
                    files = [folder / f"model{s}" for s in _SUFFIXES
                             if (folder / f"model{s}").is_file()]
                    if files:
                        found[entry.name] = (str(number), files[0])
                        break
        return found

    def index(self) -> list[dict[str, Any]]:
        entries = []
        for name, (version, _) in self.available().items():
            served = self._served.get(name)
            state = "READY" if served else "UNAVAILABLE"
            entry: dict[str, Any] = {"name": name, "version": served.version if served
                                     else version, "state": state}
            if not served:
                entry["reason"] = self._failed.get(name, "unloaded")
            entries.append(entry)
        return entries

    def get(self, name: str, version: str = "") -> ServedModel:
        served = self._served.get(name)
        if served is None:
            known = ", ".join(self._served) or "none"
            raise not_found(f"unknown model {name!r}; models served: {known}")
        if version and version != served.version:
            raise not_found(f"model {name!r} has no version {version!r}; serving version "
                            f"{served.version}")
        return served

    @property
    def models(self) -> list[ServedModel]:
        return list(self._served.values())

    # ---- loading -----------------------------------------------------------
    async def load_all(self) -> None:
        for name in self.available():
            await self.load(name)

    async def load(self, name: str) -> ServedModel:
        """Load the repository's current version of ``name`` and swap it in."""
        lock = self._locks.setdefault(name, asyncio.Lock())
        async with lock:
            found = self.available().get(name)
            if found is None:
                raise not_found(f"model {name!r} is not in the repository "
                                f"{str(self.root)!r}; it holds: "
                                f"{', '.join(self.available()) or 'nothing'}")
            version, path = found
            loop = asyncio.get_running_loop()
            try:
                served = await loop.run_in_executor(None, load_served, name, version, path,
                                                    self.options)
            except KeelError as exc:
                self._failed[name] = str(exc)
                raise ProtocolError(f"model {name!r} failed to load: {exc}") from None
            if served.batch_size is not None:
                served.batcher = Batcher(batch_runner(served), served.batch_size,
                                         self.options.max_queue_delay_s,
                                         self._observer(served), served.padded)
            old = self._served.get(name)
            self._served[name] = served
            self._failed.pop(name, None)
        if old is not None:
            await old.close()
        return served

    async def unload(self, name: str) -> None:
        served = self._served.pop(name, None)
        if served is None:
            raise not_found(f"model {name!r} is not loaded")
        self._failed[name] = "unloaded"
        await served.close()

    async def close(self) -> None:
        for name in list(self._served):
            await self._served.pop(name).close()

    def _observer(self, served: ServedModel) -> Callable[[int, int, list[float]], None] | None:
        hook = self._on_batch
        if hook is None:
            return None

        def observe(rows: int, padded: int, waited: list[float]) -> None:
            split = served.model.adaptive_plan
            runs = 1 if split is None else split.n_chunks * split.streams
            hook(served.name, rows, padded, waited, runs)

        return observe


async def run_request(repo: Repository, name: str, version: str,
                      arrays: dict[str, np.ndarray], outputs: Sequence[str] | None,
                      timeout_s: float) -> tuple[ServedModel, dict[str, np.ndarray]]:
    """One inference: the model's outputs (only those named in ``outputs``, if given)."""
    served = repo.get(name, version)
    known = [t.name for t in served.model.outputs]
    for wanted in outputs or ():
        if wanted not in known:
            raise ProtocolError(f"model {name!r} has no output {wanted!r}; its outputs are: "
                                f"{', '.join(known)}")
    served.in_flight += 1
    served.idle.clear()
    try:
        result = await asyncio.wait_for(served.infer(arrays), timeout_s)
    except asyncio.TimeoutError:
        raise ProtocolError(f"model {name!r}: the request took longer than {timeout_s:g} s",
                            504, "DEADLINE_EXCEEDED") from None
    except KeelError as exc:
        if isinstance(exc, ProtocolError):
            raise
        raise ProtocolError(f"model {name!r}: {exc}") from None
    finally:
        served.in_flight -= 1
        if not served.in_flight:
            served.idle.set()
    wanted_names = list(outputs) if outputs else known
    return served, {k: result[k] for k in wanted_names}
