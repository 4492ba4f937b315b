"""The parallelism audit: how the benchmark models' nodes split on a many-core machine.

    python -m benchmarks.threads_audit                   # 16 threads, batches 1 and 32
    python -m benchmarks.threads_audit --threads 64 --models resnet18 --all
    python -m benchmarks.threads_audit --profile probe.json --thread-costs costs.json

Plans every node of the suite's models (benchmarks/zoo.py) with keel's cpu planner for
a probed 16-core server (the ``amd-sysfs-only`` fake: a 16-core Ryzen 9 7950X, 1 MiB
L2 a core, 32 MiB L3; or ``--profile`` a saved ``keel probe --json``; with
``--thread-costs`` that machine's measured thread costs, from which the least work a
thread is derived as there, else this machine's or the declared values) and, for each
node, the parallel passes its kernel runs (keel.backends.cpu.planner.node_splits): the
work units of each, how many pieces they split into and how even those are. Nothing
runs: the split is the planner's, for the probe's cores and caches.

A compiled Winograd conv runs either as one per-thread pipeline (each thread takes
blocks of tiles through the input transform, the products and the output transform
in its own cache: one pass, counted in tiles, the busiest thread's tiles its largest
piece) or pass by pass; the table says which
for each, and a line per model and batch counts them (the planner's
winograd_pipeline, whose reason explain() gives).

Each pass of a node with work for every thread (its kernel family's least work per
thread for each of ``--threads``) must keep them evenly busy: its busiest thread's work
within the planner's EVEN_SPLIT of an even share. The table lists the nodes with a
pass that does not (FAIL) and those on fewer threads for want of work, with the
planner's reason; ``--all`` lists every node. The exit status is 1 when a node fails.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import onnx

from benchmarks.zoo import DEFAULT_MODELS, MODELS, build
from keel import load_model
from keel.backends.cpu import native_blocked, planner, thread_costs
from keel.backends.cpu.backend import CpuBackend
from keel.graph.shape_inference import propagate
from keel.hardware.fakes import fake_profile
from keel.hardware.profile import HardwareProfile
from keel.ops.registry import Op

SERVER = "amd-sysfs-only"
CONV_OPS = planner.CONV_OPS


@dataclass(frozen=True)
class Row:
    """One node's split on ``threads`` threads."""

    model: str
    batch: int
    node: str
    op: Op
    variant: str
    layout: str
    splits: tuple[planner.Split, ...]
    threads: int

    @property
    def short(self) -> tuple[planner.Split, ...]:
        """The passes with work for every thread that leave them unevenly busy."""
        return tuple(s for s in self.splits if s.worth(self.threads)
                     and s.spread(self.threads) > planner.EVEN_SPLIT)

    @property
    def pipeline(self) -> bool:
        """A Winograd conv that runs as the per-thread pipeline."""
        return bool(self.splits) and self.splits[0].name.startswith("pipeline")

    @property
    def failed(self) -> bool:
        return bool(self.short)

    @property
    def verdict(self) -> str:
        if not self.splits:
            return "not modelled"
        if self.short:
            return "FAIL"
        return "ok" if any(s.worth(self.threads) for s in self.splits) else "little work"

    def line(self) -> str:
        what = planner.split_reason(self.splits, self.threads) or "-"
        return (f"{self.model:12s} b{self.batch:<3d} {self.node:28.28s} {self.op.value:14.14s} "
                f"{self.variant:9.9s} {self.layout:16.16s} {self.verdict:12s} {what}")


def fixed_batch(model: bytes, feeds: dict[str, Any]) -> bytes:
    """``model`` with its inputs' shapes set to those of ``feeds`` (no symbolic dims)."""
    proto = onnx.load_from_string(model)
    for value in proto.graph.input:
        if value.name not in feeds:
            continue
        dims = value.type.tensor_type.shape.dim
        for dim, size in zip(dims, feeds[value.name].shape, strict=True):
            dim.Clear()
            dim.dim_value = int(size)
    return proto.SerializeToString()


def audit(name: str, batch: int, threads: int, profile: HardwareProfile) -> list[Row]:
    """Every node of benchmark model ``name`` at ``batch``, planned for ``profile`` on
    ``threads`` threads, with its kernel's split."""
    feeds = MODELS[name].make_feeds(batch)
    model = load_model(fixed_batch(build(name), feeds), backend="cpu", threads=threads,
                       hardware=profile, plan_cache=False)
    graph = model.graph
    types = propagate(graph, {k: v.shape for k, v in feeds.items()}).types
    backend = CpuBackend(threads=threads, hardware=profile)
    # a float NCHWc region's convs (and a lone blocked conv) and a conv pooled in its
    # pool's step are planned with the graph (planner.float_layouts, pool_in_conv)
    regions = {p.name: p.plan for p in model.plan.nodes if p.plan is not None and (
        p.plan.layout in native_blocked.REGION_LAYOUTS or p.plan.option("pool_in_conv")
        or p.plan.option("pooled_by"))}
    rows = []
    for node in graph.nodes:
        inputs = [types.get(i) if i else None for i in node.inputs]
        plan = regions.get(node.name) or backend.plan_node(
            node.op, inputs, node.attrs, threads=threads, profile=profile)
        splits = planner.node_splits(node.op, inputs, node.attrs, plan, threads, profile)
        rows.append(Row(name, batch, node.name, node.op, plan.variant, plan.layout, splits,
                        threads))
    return rows


def winograd_line(rows: Sequence[Row]) -> str | None:
    """How many of the rows' Winograd convs run as the per-thread pipeline, and whether
    their blocks keep every thread evenly busy (None: no Winograd conv)."""
    convs = [r for r in rows if r.op in CONV_OPS and r.variant == "winograd"]
    if not convs:
        return None
    piped = [r for r in convs if r.pipeline]
    uneven = [r.node for r in piped if r.failed]
    first = rows[0]
    return (f"{first.model} b{first.batch}: {len(piped)} of {len(convs)} Winograd conv(s) as "
            f"per-thread pipelines on {first.threads} threads"
            + (f", uneven: {', '.join(uneven)}" if uneven else ", every one evenly split")
            if piped else f"{first.model} b{first.batch}: every Winograd conv pass by pass")


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.threads_audit",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--models", default=",".join(DEFAULT_MODELS))
    p.add_argument("--batches", default="1,32")
    p.add_argument("--threads", type=int, default=16)
    p.add_argument("--profile", default=None,
                   help="a profile saved by `keel probe --json` (default: a 16-core server)")
    p.add_argument("--all", action="store_true",
                   help="list every node, not only the failing and idle ones")
    p.add_argument("--thread-costs", default=None,
                   help="that machine's measured thread costs (`keel probe --thread-costs "
                        "--json`, or its kept file): the least work a thread derived from "
                        "them, not from this machine's or the declared values")
    args = p.parse_args(argv)
    if args.thread_costs is not None:
        path = Path(args.thread_costs)
        thread_costs.adopt(thread_costs.read_costs(path), f"read from {path}")
    print(f"least work a thread: {thread_costs.current().reason}", file=sys.stderr)
    profile = (fake_profile(SERVER) if args.profile is None
               else HardwareProfile.load(args.profile))
    failed = 0
    for name in args.models.split(","):
        for batch in (int(b) for b in args.batches.split(",")):
            rows = audit(name, batch, args.threads, profile)
            for row in rows:
                failed += row.failed
                if args.all or row.verdict not in ("ok", "not modelled"):
                    print(row.line())
            summary = winograd_line(rows)
            if summary:
                print(summary)
    print(f"{failed} node(s) fail the {args.threads}-thread split", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
