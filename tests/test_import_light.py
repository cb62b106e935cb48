"""The runtime imports only onnxruntime, numpy, tokenizers and jinja2: never torch or
transformers (checked in a fresh interpreter, since this test session imports both)."""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
HEAVY = ("torch", "transformers", "onnx", "export")


def _modules_after(code: str) -> dict:
    script = code + "\nimport json, sys\nprint(json.dumps(sorted(m for m in sys.modules)))\n"
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, "-c", script], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    return set(json.loads(proc.stdout.strip().splitlines()[-1]))


def _heavy(modules: set) -> list[str]:
    return sorted(m for m in modules if m.split(".")[0] in HEAVY)


def test_runtime_imports_are_light():
    modules = _modules_after("import runtime, runtime.engine, runtime.__main__, runtime.audit, edge_spec.verify")
    assert "runtime.engine" in modules and "onnxruntime" in modules  # the import really happened
    assert _heavy(modules) == []


def test_runtime_never_imports_benchmarks():
    """benchmarks/ is not in the wheel: the runtime and its command line load without it."""
    modules = _modules_after("import runtime, runtime.engine, runtime.__main__, runtime.audit, runtime.api, runtime.handoff")
    assert "runtime.__main__" in modules
    assert sorted(m for m in modules if m.split(".")[0] == "benchmarks") == []


def _imports_benchmarks(node: ast.AST) -> bool:
    if isinstance(node, ast.Import):
        return any(alias.name.split(".")[0] == "benchmarks" for alias in node.names)
    if isinstance(node, ast.ImportFrom):  # `from benchmarks[.x] import y`; a relative import stays inside runtime/
        return node.level == 0 and (node.module or "").split(".")[0] == "benchmarks"
    if isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant):  # import_module("benchmarks...")
        name = getattr(node.func, "attr", None) or getattr(node.func, "id", None)
        return name in ("import_module", "__import__") and str(node.args[0].value).split(".")[0] == "benchmarks"
    return False


def test_no_runtime_module_imports_benchmarks():
    """The arrow runs one way (docs/architecture.md): benchmarks/ imports the runtime, no module
    under runtime/ imports benchmarks, not even inside a function or a try (which the import test
    above cannot see until that code runs)."""
    files = sorted((ROOT / "runtime").rglob("*.py"))
    assert len(files) > 10 and ROOT / "runtime" / "__main__.py" in files
    found = [f"{path.relative_to(ROOT)}:{node.lineno}"
             for path in files for node in ast.walk(ast.parse(path.read_text(), filename=str(path)))
             if _imports_benchmarks(node)]
    assert found == [], f"runtime/ imports benchmarks/ at {', '.join(found)}"


def test_generating_stays_light(llama_bundle):
    code = (
        "from runtime.engine import Engine, EngineConfig, GenerateConfig\n"
        f"engine = Engine({str(llama_bundle)!r}, EngineConfig(drafter='auto', gamma=2, calibrate=True))\n"
        "ids = engine.encode(messages=[{'role': 'user', 'content': 'hello'}])\n"
        "result = engine.generate(ids, GenerateConfig(max_new_tokens=5))\n"
        "assert 1 <= len(result.token_ids) <= 5, result\n"
    )
    modules = _modules_after(code)
    assert "runtime.drafters.draft_model" in modules
    assert _heavy(modules) == []


def test_cli_generate_stays_light(llama_bundle):
    code = (
        "import sys\n"
        "from runtime.__main__ import main\n"
        f"assert main(['generate', {str(llama_bundle)!r}, '--prompt', 'hi', '--max-new-tokens', '3', '--json', '--draft', 'layer-skip']) == 0\n"
    )
    modules = _modules_after(code)
    assert _heavy(modules) == []
