"""No function in hyperdraft/ runs over 60 lines unless a comment in it says why it must stay whole ("Kept whole")."""

from __future__ import annotations

import ast
import os

import hyperdraft

ROOT = os.path.dirname(os.path.abspath(hyperdraft.__file__))
MAX_LINES = 60


def long_functions(source: str, path: str) -> list[str]:
    """Functions of more than MAX_LINES lines (decorators excluded) whose body has no "Kept whole" comment."""
    lines = source.splitlines()
    found = []
    for node in ast.walk(ast.parse(source, path)):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            length = node.end_lineno - node.lineno + 1
            body = "\n".join(lines[node.lineno - 1 : node.end_lineno])
            if length > MAX_LINES and "Kept whole" not in body:
                found.append(f"{path}:{node.lineno} {node.name} ({length} lines)")
    return found


def test_no_long_function_without_a_reason():
    found = []
    for folder, _, files in os.walk(ROOT):
        for f in sorted(files):
            if f.endswith(".py"):
                path = os.path.join(folder, f)
                found += long_functions(open(path).read(), os.path.relpath(path, ROOT))
    assert not found, "functions over 60 lines with no 'Kept whole' comment:\n" + "\n".join(found)


def test_the_check_counts_lines():
    body = "\n".join(f"    x{i} = {i}" for i in range(MAX_LINES))
    assert long_functions(f"def f():\n{body}\n", "m.py") == ["m.py:1 f (61 lines)"]
    assert long_functions(f"def f():\n    # Kept whole: one program.\n{body}\n", "m.py") == []
    assert long_functions(f"def f():\n{body[: body.rindex(chr(10))]}\n", "m.py") == []
