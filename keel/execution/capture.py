"""Replaying a program's device work as one captured graph (CUDA graphs on the gpu backend).

A program whose every kernel runs on one device backend that can capture
(:meth:`keel.backends.base.Backend.graph_capture`) and whose shapes are fixed
runs like this:

1. its first run is an ordinary run, on the capture's stream and memory pool:
   kernels compile, library handles and per-shape plans are made, and the
   pool learns every allocation the run makes;
2. its second run copies the feeds into buffers that stay put, then records
   every launch of the run once (nothing executes while recording) and
   replays the recording;
3. every later run copies the feeds in, replays, and reads the outputs out:
   one launch for the whole model instead of one per kernel.

What a recording points at must stay put: the arena views, the weights, the
feed buffers and every array the recorded run allocated (held here), and the
arena itself (a replaced arena drops the recording, and the next run records
again). Where a program cannot be captured, :func:`decide` says why, and the
program runs step by step as before; where recording fails (a kernel that
reads a device value on the host, say), the program says why and never tries
again. ``explain()`` shows the reason either way.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from keel.backends.base import Backend, GraphCapture
from keel.config import settings
from keel.planning.plans import HOST

if TYPE_CHECKING:
    from keel.execution.program import Program

__all__ = ["CapturePlan", "Replay", "decide"]


@dataclass(frozen=True)
class CapturePlan:
    """What a capturable program does around its recording."""

    backend: Backend
    capture: GraphCapture                      # the program's own recorder
    staged: tuple[tuple[int, int, int], ...]   # (step, feed slot, device slot) per run
    once: tuple[tuple[int, int, int], ...]     # (step, constant slot, device slot) once
    fetched: tuple[int, ...]                   # copies to the host after the last kernel


def decide(program: Program) -> tuple[CapturePlan | None, str]:
    """Whether ``program`` runs as a recording, and why (the reason ``explain`` shows)."""
    steps = program._steps
    devices = {s.backend for s in steps if s.kind == "kernel"
               and program._backends[s.backend].device.value != HOST}
    if not devices:
        return None, ""                          # a host program: nothing to say
    if not settings().cuda_graphs:
        return None, "not captured: KEEL_CUDA_GRAPHS=off"
    if program.shape_generic or program.dynamic:
        return None, "not captured: the program runs inputs of any shape (no fixed sizes)"
    if len(devices) > 1:
        return None, f"not captured: kernels run on {', '.join(sorted(devices))}"
    name = devices.pop()
    backend = program._backends[name]
    capture, why = backend.graph_capture()
    if capture is None:
        return None, f"not captured: {why}"
    feeds = {*program._input_slots, *(slot for slot, _ in program._optional.values())}
    host = next((s for s in steps if s.kind == "kernel" and s.backend != name), None)
    if host is not None:
        return None, (f"not captured: node {host.name!r} ({host.op}) runs on "
                      f"{host.backend} beside the {name} nodes")
    staged, once, fetched = [], [], []
    last = max((i for i, s in enumerate(steps) if s.kind == "kernel"), default=-1)
    for index, step in enumerate(steps):
        if step.kind == "copy":
            src, dst = step.inputs[0], step.outputs[0]
            if step.src is backend and step.dst is None and index > last:
                fetched.append(index)             # an output read back after the run
            elif step.dst is not backend or step.src is not None:
                return None, (f"not captured: {step.name} copies a value back to the host "
                              "in the middle of the run")
            elif src in feeds:
                staged.append((index, src, dst))
            elif src in program._constants:
                once.append((index, src, dst))
            else:
                return None, (f"not captured: {step.name} copies a value a host node made "
                              "in the middle of the run")
        elif step.sized:
            return None, (f"not captured: node {step.name!r} ({step.op}) sizes its output "
                          "from input values")
        elif step.memo is not None or any(_is_body(a) for a in step.attrs.values()):
            return None, f"not captured: node {step.name!r} ({step.op}) decides on the host"
    return CapturePlan(backend, capture, tuple(staged), tuple(once), tuple(fetched)), \
        f"captured on {name}: recorded on its second run, replayed as one launch after"


def _is_body(value: Any) -> bool:
    from keel.execution.control import CompiledBody

    return isinstance(value, CompiledBody)


class Replay:
    """One program's recording: made on its second run, replayed on every later one."""

    def __init__(self, program: Program, plan: CapturePlan) -> None:
        self._program = program
        self._plan = plan
        self._capture = plan.capture
        self._runs = 0
        self._graph: Any = None
        self._version = -1                        # the arena version the recording uses
        self._held: dict[int, Any] = {}           # slot -> array the recording writes
        self._buffers: dict[int, Any] = {}        # device slot -> fixed feed buffer
        steps = program._steps
        # What is read after a replay: the outputs, and the sources of the copies out.
        self._wanted = {*(slot for _, slot, _ in program._outputs),
                        *(steps[i].inputs[0] for i in plan.fetched)}
        self._read: tuple[int, ...] = ()
        self.failed = ""                          # why recording failed ("" when it did not)
        self.launches = 0                         # replays so far

    @property
    def captured(self) -> bool:
        return self._graph is not None

    def run(self, outputs: Mapping[str, Any] | None, *, device: bool = False
            ) -> dict[str, Any]:
        """One run; ``device``: outputs stay the device arrays the recording writes."""
        program = self._program
        with self._capture.scope():
            if self._graph is not None and self._version != program._pool.version:
                self._drop()                      # the arena moved: record again
            if self._graph is not None:
                return self._replay(outputs, device)
            if self._runs == 0 or self.failed:
                self._runs += 1
                return program._run_steps(outputs, device=device)
            return self._record(outputs, device)

    def _record(self, outputs: Mapping[str, Any] | None, device: bool) -> dict[str, Any]:
        program = self._program
        values = program._values
        self._stage(first=True)
        plan = self._plan
        hot = program._skipping({*(index for index, _, _ in (*plan.staged, *plan.once)),
                                 *plan.fetched})
        try:
            try:
                graph = self._capture.record(lambda: program._loop(None, hot))
            except Exception as exc:
                self.failed = f"{type(exc).__name__}: {exc}"
                program.capture_reason = f"not captured: recording failed ({self.failed})"
                return program._run_steps(outputs, device=device)
            self._graph = graph
            self._version = program._pool.version
            self._held = {slot: values[slot] for slot in program._transient
                          if values[slot] is not None}
            self._read = tuple(slot for slot in self._wanted if slot in self._held)
            self._capture.launch(graph)
            self.launches += 1
            return self._finish(outputs, device)
        finally:
            program._release()

    def _replay(self, outputs: Mapping[str, Any] | None, device: bool) -> dict[str, Any]:
        program = self._program
        values = program._values
        self._stage(first=False)
        self._capture.launch(self._graph)
        self.launches += 1
        held = self._held
        for slot in self._read:
            values[slot] = held[slot]
        try:
            return self._finish(outputs, device)
        finally:
            program._release()

    def _finish(self, outputs: Mapping[str, Any] | None, device: bool) -> dict[str, Any]:
        """The outputs: left on the device, or copied to the host after the last kernel."""
        program = self._program
        if device:
            return program._collect_device()
        for index in self._plan.fetched:
            program._copy(program._steps[index])
        return program._collect(outputs)

    def _stage(self, *, first: bool) -> None:
        """Copy this run's feeds into the fixed buffers the recording reads."""
        values = self._program._values
        for copies, copy in ((self._plan.staged, True), (self._plan.once, first)):
            for _, src, dst in copies:
                value = values[src]
                buffer = self._buffers.get(dst)
                if buffer is None:
                    buffer = self._buffers[dst] = self._capture.buffer(value)
                if copy:
                    self._capture.stage(buffer, value)
                values[dst] = buffer

    def _drop(self) -> None:
        self._graph = None
        self._held = {}

