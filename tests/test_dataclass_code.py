"""keel's dataclasses take their compiled methods from the code cache
(:mod:`keel._dataclass_code`), and the classes are exactly those ``exec`` makes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from importlib.util import MAGIC_NUMBER
from pathlib import Path
from typing import Any

# Every generated method of every dataclass of the keel modules a model load imports: the
# code as the interpreter holds it, and whether this process compiled or took each module.
_CHILD = """
import dataclasses, json, sys
import keel, keel.execution.model, keel.execution.plan_cache, keel.hardware
from keel import _dataclass_code

methods = {}
for name, module in sorted(sys.modules.items()):
    if not name.startswith("keel."):
        continue
    for cls in list(vars(module).values()):
        if not (isinstance(cls, type) and dataclasses.is_dataclass(cls)
                and cls.__module__ == name):
            continue
        for method in ("__init__", "__repr__", "__eq__", "__hash__", "__setattr__",
                       "__delattr__"):
            code = getattr(cls.__dict__.get(method), "__code__", None)
            if code is not None:
                methods[f"{name}.{cls.__qualname__}.{method}"] = [
                    code.co_code.hex(), repr(code.co_consts), code.co_names,
                    code.co_varnames, code.co_freevars, code.co_filename, code.co_firstlineno]
store = _dataclass_code._STORE
print(json.dumps({"methods": methods, "compiled": sorted(store.compiled),
                  "kept": store.folder is not None, "installed": _dataclass_code.installed()}))
"""


def _run(cache: Path, code: str = _CHILD, **env: str) -> dict[str, Any]:
    environ = {k: v for k, v in os.environ.items()
               if k not in ("PYTHONDONTWRITEBYTECODE", "KEEL_CODE_CACHE")}
    environ.update(KEEL_CACHE_DIR=str(cache), **env)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True, env=environ, timeout=300)
    result: dict[str, Any] = json.loads(out.stdout.strip().splitlines()[-1])
    return result


def _folder(cache: Path) -> Path:
    return cache / "code" / str(sys.implementation.cache_tag)


def test_a_second_process_takes_every_method_and_gets_the_same_classes(tmp_path: Path) -> None:
    first = _run(tmp_path)
    assert first["installed"] and first["kept"]
    assert "keel.execution.model" in first["compiled"]      # nothing kept yet: compiled, stored
    files = {p.name for p in _folder(tmp_path).iterdir()}
    assert "keel.execution.model.marshal" in files and "keel.config.marshal" not in files
    second = _run(tmp_path)
    assert second["compiled"] == []                        # every method from the files
    reference = _run(tmp_path / "unused", KEEL_CODE_CACHE="off")
    assert not reference["kept"] and reference["compiled"] == []
    assert len(reference["methods"]) > 300
    assert second["methods"] == reference["methods"] == first["methods"]


def test_corrupt_foreign_or_untrusted_files_are_compiled_again_and_replaced(
        tmp_path: Path) -> None:
    _run(tmp_path)
    folder = _folder(tmp_path)
    corrupt, foreign, open_to_all = (folder / f"keel.{name}.marshal" for name in
                                     ("execution.model", "graph.ir", "backends.base"))
    corrupt.write_bytes(MAGIC_NUMBER + b"\x00not marshal")
    foreign.write_bytes(b"\x00\x00\r\n" + foreign.read_bytes()[len(MAGIC_NUMBER):])
    open_to_all.chmod(0o666)
    again = _run(tmp_path)
    assert {"keel.execution.model", "keel.graph.ir", "keel.backends.base"} <= \
        set(again["compiled"])
    assert again["methods"] == _run(tmp_path / "unused", KEEL_CODE_CACHE="off")["methods"]
    for path in (corrupt, foreign):                       # rewritten whole at exit
        assert path.read_bytes().startswith(MAGIC_NUMBER)
    assert _run(tmp_path)["compiled"] == []


def test_nothing_is_written_without_bytecode_writing_or_when_off(tmp_path: Path) -> None:
    assert _run(tmp_path / "b", PYTHONDONTWRITEBYTECODE="1")["compiled"]
    assert not (tmp_path / "b" / "code").exists()
    assert _run(tmp_path / "off", KEEL_CODE_CACHE="off")["compiled"] == []
    assert not (tmp_path / "off" / "code").exists()


def test_other_dataclasses_are_left_to_exec(tmp_path: Path) -> None:
    code = ("import dataclasses, json, keel, keel.execution.model\n"
            "from keel import _dataclass_code\n"
            "@dataclasses.dataclass(frozen=True)\n"
            "class Point:\n    x: int\n    y: int = 2\n"
            "p = Point(1)\n"
            "try:\n    p.x = 3\n    frozen = False\n"
            "except dataclasses.FrozenInstanceError:\n    frozen = True\n"
            "print(json.dumps({'repr': repr(p), 'frozen': frozen, 'eq': p == Point(1, 2),\n"
            "                  'modules': sorted(_dataclass_code._STORE.taken)}))\n")
    result = _run(tmp_path, code)
    assert result["repr"] == "Point(x=1, y=2)" and result["frozen"] and result["eq"]
    assert "__main__" not in result["modules"] and "keel.execution.model" in result["modules"]
    assert not (_folder(tmp_path) / "__main__.marshal").exists()
