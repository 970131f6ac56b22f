"""Render a client-supplied chat template in a child process that can be killed.

A Jinja template is a program: `{{ 'ab' * 50000000 }}` allocates 100 MB in one step, and nested loops over
`range` spin for hours without writing a byte, so neither a thread nor an output cap can bound it. The server
therefore renders client templates (only with --allow-client-chat-template) here, in a child `python
template_sandbox.py`, under a wall-clock timeout (the parent kills the process), an address-space
limit, and Jinja's sandbox with string operations and the rendered text capped at max_chars.

Protocol: one JSON object on stdin {"template", "messages", "kwargs", "max_chars"}; one on stdout, {"text"} or
{"error"}. Only jinja2 is imported, so a render costs a process start (~50 ms), not a model load.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys

MEMORY_LIMIT_BYTES = 1 << 30


class RenderRefused(Exception):
    """The template failed, ran too long, or wrote too much; the message says which, for the client."""


async def render_in_sandbox(template: str, messages: list[dict], kwargs: dict, max_chars: int,
                            timeout_s: float) -> str:
    """The rendered chat text, or RenderRefused. Never blocks the event loop: the child runs beside it."""
    request = json.dumps({"template": template, "messages": messages, "kwargs": kwargs, "max_chars": max_chars})
    # Run as a script by path, not with -m: importing the hyperdraft package would load torch (seconds).
    proc = await asyncio.create_subprocess_exec(
        sys.executable, os.path.abspath(__file__), stdin=asyncio.subprocess.PIPE,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.DEVNULL)
    try:
        out, _ = await asyncio.wait_for(proc.communicate(request.encode()), timeout_s)
    except asyncio.TimeoutError:
        raise RenderRefused(f"the chat template did not finish rendering within {timeout_s:g} s") from None
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
    try:
        answer = json.loads(out)
    except ValueError:  # killed by its memory limit, or died otherwise
        raise RenderRefused("the chat template exhausted the renderer's memory") from None
    if "error" in answer:
        raise RenderRefused(f"the chat template failed: {answer['error']}")
    return answer["text"]


def _render(request: dict) -> str:
    from jinja2.exceptions import SecurityError
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    max_chars = int(request["max_chars"])

    class CappedEnvironment(ImmutableSandboxedEnvironment):
        intercepted_binops = frozenset(["*", "+", "**"])

        def call_binop(self, context, operator, left, right):
            if operator == "**" and isinstance(right, (int, float)) and abs(right) > 64:
                raise SecurityError("exponent too large")
            if operator == "*" and isinstance(left, (str, list)) and isinstance(right, int):
                if len(left) * right > max_chars:
                    raise SecurityError(f"a repeated string would exceed {max_chars} characters")
            if operator == "*" and isinstance(right, (str, list)) and isinstance(left, int):
                if len(right) * left > max_chars:
                    raise SecurityError(f"a repeated string would exceed {max_chars} characters")
            return super().call_binop(context, operator, left, right)

    def raise_exception(message):
        raise ValueError(message)

    env = CappedEnvironment(trim_blocks=True, lstrip_blocks=True)
    env.globals["raise_exception"] = raise_exception
    template = env.from_string(request["template"])
    pieces, size = [], 0
    for piece in template.generate(messages=request["messages"], add_generation_prompt=True, **request["kwargs"]):
        size += len(piece)
        if size > max_chars:
            raise SecurityError(f"the rendered text exceeds {max_chars} characters")
        pieces.append(piece)
    return "".join(pieces)


def main() -> None:
    import resource

    resource.setrlimit(resource.RLIMIT_AS, (MEMORY_LIMIT_BYTES, MEMORY_LIMIT_BYTES))
    try:
        answer = {"text": _render(json.load(sys.stdin))}
    except MemoryError:
        answer = {"error": "the template exhausted the renderer's memory"}
    except Exception as e:  # noqa: BLE001 - whatever the template did wrong goes back as the client's error
        answer = {"error": f"{type(e).__name__}: {e}"}
    json.dump(answer, sys.stdout)


if __name__ == "__main__":
    main()
