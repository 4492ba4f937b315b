"""Data flows one way: a stage of keel imports only stages upstream of it and the shared
leaves (docs/architecture.md), never one downstream, not even lazily inside a function."""

from __future__ import annotations

import ast
from pathlib import Path

import keel

ROOT = Path(keel.__file__).parent

# Upstream first. The shared leaves come before every stage; modules of one stage may
# import each other.
STAGES = ["errors", "dtypes", "config", "inference_protocol", "_hashing", "_files", "_fork", "_gc",
          "_dataclass_code",
          "hardware", "ops", "graph", "formats", "native", "backends", "planning",
          "execution", "tensors", "runtime", "onnx_backend", "torch_graph", "bench", "testing",
          "serving", "integrations", "onnxruntime", "cli", "__main__"]
# Names taken from the package root (``from keel import X``) that are leaves or stages
# upstream of everyone who takes them: the version, settings and the native tier.
ROOT_NAMES = {"__version__", "config", "native"}
# The one root import the design makes on purpose: the graph stage asks the root package
# for the executor it wires in as the evaluator (docs/architecture.md, "One interpreter").
ROOT_MODULE_IMPORTS = {"graph/shape_inference.py"}
# Front ends from here on sit with the root package above the runtime and may use its API.
FRONT_ENDS = STAGES.index("serving")


def _stage(module: str) -> str | None:
    parts = module.split(".")
    return parts[1] if parts[0] == "keel" and len(parts) > 1 else None


def _imports(tree: ast.AST) -> list[tuple[int, str, list[str]]]:
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.append((node.lineno, node.module, [a.name for a in node.names]))
        elif isinstance(node, ast.Import):
            found += [(node.lineno, a.name, []) for a in node.names]
    return found


def test_no_stage_imports_a_stage_downstream_of_it() -> None:
    wrong = []
    for path in sorted(ROOT.rglob("*.py")):
        rel = path.relative_to(ROOT)
        own = rel.parts[0].removesuffix(".py")
        if own == "__init__":
            continue                    # the root package sits above every stage
        assert own in STAGES, f"{rel}: add its stage to STAGES"
        for line, module, names in _imports(ast.parse(path.read_text(encoding="utf-8"))):
            if module == "keel":
                if STAGES.index(own) >= FRONT_ENDS:
                    continue
                if names and set(names) <= ROOT_NAMES:
                    continue
                if not names and rel.as_posix() in ROOT_MODULE_IMPORTS:
                    continue
                wrong.append(f"{rel}:{line} imports the package root ({', '.join(names)})")
                continue
            stage = _stage(module)
            if stage is None or stage == own:
                continue
            assert stage in STAGES, f"{rel}:{line}: {module} is in no known stage"
            if STAGES.index(stage) > STAGES.index(own):
                wrong.append(f"{rel}:{line} imports {module}, downstream of {own}")
    assert wrong == []
