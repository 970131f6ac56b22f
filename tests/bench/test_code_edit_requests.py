"""benchmarks/common.code_edit_requests (real_accept --task code-edit): as many distinct requests as asked, each one
of the edit requests followed by one whole function (or method, as indented in its class) of hyperdraft's source."""

from __future__ import annotations

import ast
import textwrap

from benchmarks.common import EDIT_REQUESTS, code_edit_requests


def test_requests_quote_whole_functions():
    requests = code_edit_requests(12)
    assert len(requests) == 12 and len(set(requests)) == 12
    for i, request in enumerate(requests):
        ask, code = request.split("\n\n```python\n")
        template = EDIT_REQUESTS[i % len(EDIT_REQUESTS)]
        assert ask == (template.format(name=ask.split("`")[1]) if "{name}" in template else template)
        body = textwrap.dedent(code.removesuffix("\n```"))
        tree = ast.parse(body)
        assert len(tree.body) == 1 and isinstance(tree.body[0], ast.FunctionDef)
        assert 8 <= len(body.splitlines()) <= 30
