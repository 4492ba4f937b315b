"""Planners decide, kernels execute: no backend module outside a planner holds a decision.

A decision is found by shape, not by reading every line:

* a module-level UPPER_CASE constant whose value is a number (or arithmetic on
  numbers): a threshold, a budget, a measured limit;
* a function named like a decision (``choose*``, ``pick*``, ``decide*``,
  ``*_wins``, ``set_*scheme``): a choice made where it runs;
* in the C sources, a function named ``*_wins`` or ``*_serves``: a choice
  made inside a kernel.

The planner modules (``backends/plan.py``, ``cpu/planner.py``,
``cpu/conv_rules.py``, ``gpu/planner.py``) are where these belong. Every
exception elsewhere is listed in ``planner_allowlist.txt`` with the reason it
stays; an unlisted finding fails, and so does a listed one that is gone.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
BACKENDS = ROOT / "keel" / "backends"
C_SOURCES = ROOT / "keel" / "native" / "src"
ALLOWLIST = Path(__file__).with_name("planner_allowlist.txt")
PLANNERS = frozenset({"keel/backends/plan.py", "keel/backends/cpu/planner.py",
                      "keel/backends/webgpu/planner.py",
                      "keel/backends/cpu/conv_rules.py", "keel/backends/gpu/planner.py"})

_CONSTANT = re.compile(r"^_?[A-Z][A-Z0-9_]*$")
_DECIDER = re.compile(r"^_?(choose|pick|decide)\w*$|^\w+_wins$|^set_\w*scheme$")
_C_DECIDER = re.compile(r"^(?:static\s+)?(?:inline\s+)?\w[\w\s\*]*?\b(\w+_(?:wins|serves))\s*\(")


def _numeric(node: ast.expr) -> bool:
    """A number, or arithmetic on numbers only (``4 * 2**20``, ``1 << 20``, ``-0.75``)."""
    if isinstance(node, ast.Constant):
        return isinstance(node.value, (int, float)) and not isinstance(node.value, bool)
    if isinstance(node, ast.UnaryOp):
        return _numeric(node.operand)
    if isinstance(node, ast.BinOp):
        return _numeric(node.left) and _numeric(node.right)
    return False


def _named(target: ast.expr, value: ast.expr) -> list[tuple[str, ast.expr]]:
    """(name, value) of each name ``target`` assigns, a tuple target's names paired with
    the tuple value's elements (``A, B = 1, 2``)."""
    if isinstance(target, ast.Name):
        return [(target.id, value)]
    if (isinstance(target, (ast.Tuple, ast.List)) and isinstance(value, (ast.Tuple, ast.List))
            and len(target.elts) == len(value.elts)):
        return [pair for t, v in zip(target.elts, value.elts, strict=True)
                for pair in _named(t, v)]
    return []


def _python_findings(rel: str, source: str) -> set[str]:
    tree = ast.parse(source)
    found = set()
    for stmt in tree.body:
        targets: list[ast.expr] = []
        value = None
        if isinstance(stmt, ast.Assign):
            targets, value = stmt.targets, stmt.value
        elif isinstance(stmt, ast.AnnAssign) and stmt.value is not None:
            targets, value = [stmt.target], stmt.value
        if value is not None:
            found |= {f"{rel}:{name}" for t in targets for name, v in _named(t, value)
                      if _CONSTANT.match(name) and _numeric(v)}
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and _DECIDER.match(
                node.name):
            found.add(f"{rel}:{node.name}()")
    return found


def _c_findings(rel: str, source: str) -> set[str]:
    found = set()
    for line in source.splitlines():
        match = _C_DECIDER.match(line)
        if match and not line.rstrip().endswith(";"):
            found.add(f"{rel}:{match.group(1)}()")
    return found


def findings() -> set[str]:
    """Every decision-shaped name outside the planner modules."""
    found: set[str] = set()
    for path in sorted(BACKENDS.rglob("*.py")):
        rel = path.relative_to(ROOT).as_posix()
        if rel not in PLANNERS:
            found |= _python_findings(rel, path.read_text(encoding="utf-8"))
    for path in sorted(C_SOURCES.glob("*.c")):
        found |= _c_findings(path.relative_to(ROOT).as_posix(),
                             path.read_text(encoding="utf-8"))
    return found


def allowlist() -> dict[str, str]:
    """{finding: why it stays} from planner_allowlist.txt (``name | reason`` lines)."""
    listed: dict[str, str] = {}
    for number, line in enumerate(ALLOWLIST.read_text(encoding="utf-8").splitlines(), 1):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        name, sep, why = (part.strip() for part in line.partition("|"))
        assert sep and why, f"planner_allowlist.txt:{number}: 'name | reason' expected"
        assert name not in listed, f"planner_allowlist.txt:{number}: {name} listed twice"
        listed[name] = why
    return listed


def test_no_unlisted_decision_outside_the_planners() -> None:
    unlisted = sorted(findings() - set(allowlist()))
    assert not unlisted, (
        "decision-shaped names outside the planner modules (move them into the backend's "
        "planner, or list them with a reason in planner_allowlist.txt):\n  "
        + "\n  ".join(unlisted))


def test_no_stale_allowlist_entry() -> None:
    stale = sorted(set(allowlist()) - findings())
    assert not stale, "planner_allowlist.txt lists names that are gone:\n  " + "\n  ".join(stale)


def test_the_scanner_finds_what_it_looks_for() -> None:
    """The check itself: thresholds and deciders are found; tuples, strings, flags,
    local constants and other functions are not."""
    source = (
        "A = 4 * 2**20\nB: float = -0.75\nC = (1, 2)\nD = 'x'\nE = True\nlower = 3\n"
        "def _choose(geo): return 1\ndef band_wins(geo): return True\n"
        "def set_bind_scheme(s): pass\ndef build(geo):\n    F = 4\n    return F\n"
        "G, _H, i = 0, 1 << 4, 2\nJ, K = 'x', 3\n(L, M), N = (1, 'y'), (2, 3)\n"
    )
    assert _python_findings("m.py", source) == {
        "m.py:A", "m.py:B", "m.py:_choose()", "m.py:band_wins()", "m.py:set_bind_scheme()",
        "m.py:G", "m.py:_H", "m.py:K", "m.py:L"}
    c_source = (
        "static int tall_serves(const problem *g, const epilogue *e)\n{\n"
        "static int blocked_wins(const geom *g, int64_t planes) {\n"
        "static int tall_serves(const problem *g, const epilogue *e);\n"
        "    if (tall_serves(g, e)) {\n"
    )
    assert _c_findings("k.c", c_source) == {"k.c:tall_serves()", "k.c:blocked_wins()"}
