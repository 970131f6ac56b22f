"""Preprocessor: a parsed request -> token ids, within limits and off the event loop.

The event loop answers every client, so nothing that grows with a request's size may run on it. The order:
  1. cheap checks on the parsed request: sequences per request (prompts x n), characters of prompt text,
     client-supplied chat templates (refused unless --allow-client-chat-template);
  2. template rendering, tokenization and the echo's decoding in a small thread pool, each thread with its own
     tokenizer copy (fast tokenizers are not safe to share across threads). HF tokenizers release the GIL while
     encoding: measured 8 ms worst event-loop lag while a worker encoded 900k characters (0.8 s of work);
  3. a client template in a killable child process instead (template_sandbox.py);
  4. a wall-clock limit on each of 2 and 3: a request that outlives it is answered with a 400. A child process is
     killed; a thread finishes in the background, but its work is bounded by the character limit.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import copy
import threading
from dataclasses import dataclass
from typing import Any, Callable, TypeVar

from hyperdraft.request import first_invalid_token
from hyperdraft.server.options import RequestLimits
from hyperdraft.server.protocol import APIError, ChatCompletionRequest, CompletionRequest
from hyperdraft.server.template_sandbox import RenderRefused, render_in_sandbox

DEFAULT_COMPLETION_MAX_TOKENS = 16  # OpenAI's default for /v1/completions; chat defaults to the rest of the context
PREPROCESS_THREADS = 2
_T = TypeVar("_T")


@dataclass(frozen=True)
class PreparedRequest:
    inputs: list[list[int]]  # token ids per prompt
    max_new_tokens: int
    echo: list[str] | None  # per prompt, when the request echoes it


class Preprocessor:
    def __init__(self, tokenizer, limits: RequestLimits, context_len: int, vocab_size: int):
        self.tokenizer, self.limits, self.context_len, self.vocab_size = tokenizer, limits, context_len, vocab_size
        self._local = threading.local()
        self._pool = concurrent.futures.ThreadPoolExecutor(PREPROCESS_THREADS, thread_name_prefix="hyperdraft-tokenize")

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

    async def prepare(self, req: CompletionRequest | ChatCompletionRequest) -> PreparedRequest:
        self._check_limits(req)
        if isinstance(req, ChatCompletionRequest):
            prepared = await self._prepare_chat(req)
        else:
            prepared = await self._off_loop(lambda tok: self._prepare_completion(tok, req))
        self._check_room(req, prepared)
        return prepared

    def _check_room(self, req, prepared: PreparedRequest) -> None:
        """Tokens asked for must fit the context after the prompt: OpenAI, vLLM and SGLang refuse the request (the
        engine would end the answer at the context instead, and max_tokens of 10**9 ran for minutes)."""
        chat = isinstance(req, ChatCompletionRequest)
        asked = req.requested_max_tokens if chat else req.max_tokens
        longest = max(len(ids) for ids in prepared.inputs)
        if asked is None or longest >= self.context_len:  # the engine refuses a prompt that fills the context itself
            return
        if longest + asked > self.context_len:
            field = "max_completion_tokens" if chat and req.max_completion_tokens is not None else "max_tokens"
            raise APIError(400, f"this model's context length is {self.context_len} tokens; the prompt has {longest} "
                                f"and {field} asks for {asked} more ({longest + asked} in all)", field,
                           "context_length_exceeded")

    # ---- 1. cheap checks ----------------------------------------------------------------------------------------
    def _check_limits(self, req) -> None:
        limits = self.limits
        chat = isinstance(req, ChatCompletionRequest)
        prompts = [] if chat else req.prompts()
        count = 1 if chat else len(prompts)
        if count * req.num_choices > limits.max_sequences:
            raise APIError(400, f"a request may ask for at most {limits.max_sequences} sequences (prompts x n); this "
                                f"one asks for {count} x {req.num_choices}", "n", "invalid_value")
        chars = sum(len(m.text()) for m in req.messages) if chat else sum(
            len(p) for p in prompts if isinstance(p, str))
        if chars > limits.max_prompt_chars:
            raise APIError(400, f"the prompt has {chars} characters; this server takes at most "
                                f"{limits.max_prompt_chars} (--max-prompt-chars)", "messages" if chat else "prompt",
                           "context_length_exceeded")
        if chat and req.client_chat_template() is not None and not limits.allow_client_chat_template:
            raise APIError(400, "client-supplied chat templates are refused unless the server runs with "
                                "--allow-client-chat-template", "chat_template", "unsupported_parameter")

    # ---- 2-4. off the event loop, within the time limit ---------------------------------------------------------
    async def _off_loop(self, fn: Callable[[Any], _T]) -> _T:
        """fn(a tokenizer of the worker thread's own) in the pool, within the render timeout."""
        work = asyncio.wrap_future(self._pool.submit(lambda: fn(self._thread_tokenizer())))
        try:
            return await asyncio.wait_for(work, self.limits.render_timeout_s)
        except asyncio.TimeoutError:
            raise APIError(400, f"rendering or tokenizing the prompt took longer than {self.limits.render_timeout_s:g}"
                                " s (--render-timeout)", None, "render_timeout") from None

    def _thread_tokenizer(self):
        tok = getattr(self._local, "tokenizer", None)
        if tok is None and self.tokenizer is not None:
            tok = self._local.tokenizer = copy.deepcopy(self.tokenizer)
        return tok

    async def _prepare_chat(self, req: ChatCompletionRequest) -> PreparedRequest:
        if self.tokenizer is None or not self.tokenizer.chat_template:
            raise APIError(400, "this model's tokenizer has no chat template; use /v1/completions", "messages",
                           "unsupported_parameter")
        messages = [m.template_dict(i) for i, m in enumerate(req.messages)]
        kwargs = {k: v for k, v in (req.chat_template_kwargs or {}).items() if k != "chat_template"}
        template = req.client_chat_template()
        if template is None:
            text = await self._off_loop(lambda tok: _render(tok, messages, kwargs))
        else:
            try:
                text = await render_in_sandbox(template, messages, kwargs, self.limits.max_prompt_chars,
                                               self.limits.render_timeout_s)
            except RenderRefused as e:
                raise APIError(400, str(e), "chat_template", "invalid_value") from None
        if len(text) > self.limits.max_prompt_chars:
            raise APIError(400, f"the rendered chat has {len(text)} characters; this server takes at most "
                                f"{self.limits.max_prompt_chars} (--max-prompt-chars)", "messages",
                           "context_length_exceeded")
        ids = await self._off_loop(lambda tok: tok.encode(text, add_special_tokens=False))  # the template wrote any BOS
        max_new = req.requested_max_tokens or max(1, self.context_len - len(ids))
        return PreparedRequest([ids], max_new, None)

    def _prepare_completion(self, tok, req: CompletionRequest) -> PreparedRequest:
        prompts = req.prompts()
        max_new = req.max_tokens or DEFAULT_COMPLETION_MAX_TOKENS
        if isinstance(prompts[0], str):
            if tok is None:
                raise APIError(400, "text prompts need a tokenizer, but the server runs with --skip-tokenizer-init; "
                                    "send token ids", "prompt", "invalid_type")
            return PreparedRequest([tok.encode(p) for p in prompts], max_new, list(prompts) if req.echo else None)
        check_token_ids(prompts, self.vocab_size)
        echo = [tok.decode(p) if tok is not None else "" for p in prompts] if req.echo else None
        return PreparedRequest(prompts, max_new, echo)


def _render(tok, messages: list[dict], kwargs: dict) -> str:
    try:
        return tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True, **kwargs)
    except Exception as e:  # noqa: BLE001 - jinja's TemplateError and the like: the messages do not fit the template
        raise APIError(400, f"the chat template rejected the messages: {e}", "messages", "invalid_value") from None


def check_token_ids(prompts: list[list[int]], vocab_size: int) -> None:
    """Before anything decodes them: an id outside the vocabulary would overflow or index out of range there."""
    for i, ids in enumerate(prompts):
        bad = first_invalid_token(ids, vocab_size)
        if bad is not None:
            where = "prompt" if len(prompts) == 1 else f"prompt[{i}]"
            raise APIError(400, f"{where} must hold token ids in [0, {vocab_size}), got {bad}", "prompt",
                           "invalid_value")
