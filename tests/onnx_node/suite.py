"""onnx's node test cases, built in memory, run through ``keel.onnx_backend``.

``python tests/onnx_node/suite.py`` runs every case and rewrites
``known_failures.txt`` (one ``case: reason`` line per failing case, grouped by
op), merging: a case still failing keeps the reason the file gives it, a case
that now passes leaves the list, and a newly failing case gets the reason
``UNEXPLAINED: <its error>``, which the test suite rejects until someone writes
why it fails. ``--backend reference`` or ``--report`` only print the counts.
"""

from __future__ import annotations

import argparse
import functools
import sys
import time
import warnings
from collections import defaultdict
from pathlib import Path
from typing import Any

import numpy as np

KNOWN_FAILURES = Path(__file__).with_name("known_failures.txt")
BACKEND = "cpu"
PLACEHOLDER = "UNEXPLAINED"     # the reason of a newly failing case, until one is written


@functools.lru_cache(maxsize=1)
def node_cases() -> list[Any]:
    """Every node case of the installed onnx package, sorted by name."""
    from onnx.backend.test.loader import load_node_model_tests

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")     # the generators overflow casts on purpose
        cases = load_node_model_tests()
    return sorted(cases, key=lambda c: c.name)


def load_known_failures(path: Path = KNOWN_FAILURES) -> dict[str, str]:
    """``{case name: reason}`` from the known-failures file (``#`` lines are comments)."""
    known: dict[str, str] = {}
    if not path.exists():
        return known
    for number, raw in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        name, sep, reason = line.partition(":")
        if not sep or not reason.strip():
            raise ValueError(f"{path.name}:{number}: expected 'case: reason', got {line!r}")
        known[name.strip()] = reason.strip()
    return known


def run_case(case: Any, backend: str = BACKEND) -> None:
    """Run one case on keel; raises when an output differs from onnx's expected one."""
    from onnx import TensorProto, numpy_helper
    from onnx.backend.test.runner import Runner

    from keel import onnx_backend

    def normalize(x: Any) -> Any:
        return numpy_helper.to_array(x) if isinstance(x, TensorProto) else x

    rep = onnx_backend.prepare(case.model, "CPU", backend=backend)
    for inputs, expected in case.data_sets:
        outputs = rep.run([normalize(x) for x in inputs])
        Runner.assert_similar_outputs([normalize(x) for x in expected], list(outputs),
                                      rtol=case.rtol, atol=case.atol)


@functools.lru_cache(maxsize=1)
def _single_op_cases() -> dict[str, str]:
    return {c.name: c.model.graph.node[0].op_type for c in node_cases()
            if len({n.op_type for n in c.model.graph.node}) == 1}


def op_of(case: Any) -> str:
    """The op a case tests: its only op, else that of the longest single-op case prefixing it."""
    single = _single_op_cases()
    if case.name in single:
        return single[case.name]
    best = max((n for n in single if case.name.startswith(n + "_")), key=len, default="")
    return single[best] if best else case.model.graph.node[-1].op_type


def reason_of(exc: BaseException) -> str:
    """One line: the error type and the start of its message."""
    text = " ".join(str(exc).split())
    for prefix in ("[UNSUPPORTED_OPERATION] ", "[INVALID_ARGUMENT] ", "[MODEL_FORMAT] ",
                   "[EXECUTION] ", "[VERIFICATION] "):
        text = text.replace(prefix, "")
    if isinstance(exc, AssertionError):
        text = "wrong result: " + _first_lines(text)
    return f"{type(exc).__name__}: {text}"[:200]


def _first_lines(text: str) -> str:
    return text.replace("Not equal to tolerance rtol=0.001, atol=1e-07", "").strip()


def run_all(backend: str = BACKEND) -> tuple[dict[str, str], dict[str, float]]:
    """Failures ``{case: reason}`` and seconds per case."""
    failures: dict[str, str] = {}
    seconds: dict[str, float] = {}
    with np.errstate(all="ignore"), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for case in node_cases():
            start = time.perf_counter()
            try:
                run_case(case, backend)
            except Exception as exc:
                failures[case.name] = reason_of(exc)
            seconds[case.name] = time.perf_counter() - start
    return failures, seconds


def merge_failures(known: dict[str, str], failures: dict[str, str]) -> dict[str, str]:
    """The new list: every case in ``failures`` (``{case: error}`` of this run), with the
    reason ``known`` gives it, else ``UNEXPLAINED: <error>``; cases that pass drop out."""
    merged = {}
    for name, error in failures.items():
        reason = known.get(name, "")
        merged[name] = (reason if reason and not reason.startswith(PLACEHOLDER)
                        else f"{PLACEHOLDER}: {error}")
    return merged


def write_known_failures(failures: dict[str, str], total: int, backend: str,
                         path: Path = KNOWN_FAILURES) -> None:
    """Write ``{case: reason}`` to ``path``, grouped by op."""
    by_op: dict[str, list[str]] = defaultdict(list)
    ops = {c.name: op_of(c) for c in node_cases()}
    for name in sorted(failures):
        by_op[ops.get(name, "?")].append(name)
    lines = [
        f"# onnx node cases keel's {backend} backend does not pass: one 'case: reason' line each,",
        "# grouped by op. A listed case that passes fails the suite, so this list stays true.",
        "# Regenerate with: python tests/onnx_node/suite.py (it keeps these reasons; a newly",
        f"# failing case gets '{PLACEHOLDER}: <error>', to replace with why it fails).",
        f"# {total - len(failures)} of {total} cases pass.",
    ]
    for op in sorted(by_op, key=str.lower):
        lines.append("")
        lines.append(f"## {op} ({len(by_op[op])})")
        lines += [f"{name}: {failures[name]}" for name in by_op[op]]
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--backend", default=BACKEND)
    parser.add_argument("--report", action="store_true", help="print only; do not write")
    args = parser.parse_args(argv)
    start = time.perf_counter()
    failures, seconds = run_all(args.backend)
    total = len(node_cases())
    if not args.report and args.backend == BACKEND:
        known = load_known_failures()
        merged = merge_failures(known, failures)
        write_known_failures(merged, total, args.backend)
        new = sorted(n for n, r in merged.items() if r.startswith(PLACEHOLDER))
        print(f"{KNOWN_FAILURES.name}: {len(merged) - len(new)} reasons kept, "
              f"{len(set(known) - set(merged))} passing cases removed, {len(new)} new "
              f"failures marked {PLACEHOLDER}" + (f": {', '.join(new[:5])}" if new else ""))
    print(f"{total - len(failures)} / {total} pass on {args.backend} "
          f"in {time.perf_counter() - start:.1f} s")
    slow = sorted(seconds.items(), key=lambda kv: -kv[1])[:5]
    print("slowest:", ", ".join(f"{n} {s:.2f}s" for n, s in slow))
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
    sys.exit(main())
