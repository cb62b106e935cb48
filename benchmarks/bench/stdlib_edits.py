"""Edit prompts made at run time from this Python's standard library: unannotated functions to
annotate, so the set is never tuned on and no third-party source is stored in the repository."""

from __future__ import annotations

import ast
import hashlib
import sys
import sysconfig
from pathlib import Path

INSTRUCTION = ("Add type hints and a docstring to this function. Keep its behaviour exactly as it is "
               "and reply with the full function only.")
SKIP = ("test", "tests", "idlelib", "tkinter", "turtledemo", "lib2to3", "ensurepip", "site-packages", "__pycache__")


def _unannotated(node: ast.FunctionDef) -> bool:
    args = node.args
    every = [*args.posonlyargs, *args.args, *args.kwonlyargs, *(a for a in (args.vararg, args.kwarg) if a)]
    return node.returns is None and all(a.annotation is None for a in every)


def stdlib_functions(min_lines: int = 12, max_lines: int = 40) -> list[tuple[str, str]]:
    """(module.function, source) for every top-level, undecorated, unannotated function of the
    given length with no docstring, across the standard library's own modules."""
    root = Path(sysconfig.get_paths()["stdlib"])
    found = []
    for path in sorted(root.rglob("*.py")):
        if any(part in SKIP for part in path.relative_to(root).parts):
            continue
        try:
            source = path.read_text(encoding="utf-8")
            tree = ast.parse(source)
        except (SyntaxError, UnicodeDecodeError, ValueError):
            continue
        module = ".".join(path.relative_to(root).with_suffix("").parts)
        for node in tree.body:
            if (isinstance(node, ast.FunctionDef) and not node.decorator_list and _unannotated(node)
                    and ast.get_docstring(node) is None and not node.name.startswith("_")
                    and min_lines <= node.end_lineno - node.lineno + 1 <= max_lines):
                found.append((f"{module}.{node.name}", ast.get_source_segment(source, node)))
    return found


def stdlib_edit_prompts(n: int) -> list[dict]:
    """n edit prompts, spread over the library by a hash of each function's name (stable for a
    given Python version, which the ids carry)."""
    functions = sorted(stdlib_functions(), key=lambda item: hashlib.sha256(item[0].encode()).hexdigest())
    version = f"py{sys.version_info.major}{sys.version_info.minor}"
    return [{"id": f"stdlib-{version}-{name}", "category": "edit",
             "messages": [{"role": "user", "content": f"{INSTRUCTION}\n\n```python\n{source}\n```"}]}
            for name, source in functions[:n]]
