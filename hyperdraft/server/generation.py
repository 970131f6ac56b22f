"""Generation: one HTTP request's choices, from submission to the JSON answer or the SSE stream.

Runs on the asyncio thread. Engine events arrive on a per-request asyncio.Queue; each choice has its own
IncrementalDetokenizer, so a step that accepts several tokens streams exactly their text, never half a UTF-8
character and never any part of a stop string. Logprobs are the chosen tokens' (the engine computes no top
alternatives). Token strings in logprobs are each token decoded after the one before it (detokenizer.token_texts:
a SentencePiece piece keeps its leading space), so a token that holds part of a multi-byte character shows U+FFFD,
and text_offset counts those strings.
"""

from __future__ import annotations

import asyncio
import json
import math
import time
import uuid
from dataclasses import dataclass, field
from typing import AsyncIterator

from hyperdraft.detokenizer import IncrementalDetokenizer, token_bytes, token_texts
from hyperdraft.sampling_params import SamplingParams
from hyperdraft.server.engine_loop import EngineLoop, Event, QueueFull, Submission
from hyperdraft.server.metrics import ServerMetrics
from hyperdraft.server.preprocess import Preprocessor
from hyperdraft.server.protocol import APIError, ChatCompletionRequest, CompletionRequest, engine_error

DONE = "data: [DONE]\n\n"
LOGPROB_FLOOR = -9999.0


@dataclass
class ServerContext:
    """What every request needs from the server; built once at start-up."""

    engine_loop: EngineLoop
    tokenizer: object | None  # the event loop's own copy (streaming detokenization): never the engine thread's
    preprocessor: Preprocessor  # prompt rendering and tokenization, off the event loop
    metrics: ServerMetrics
    model_name: str  # --served-model-name, or the model's base name: never a path
    context_len: int
    lossy: bool  # simulated acceptance (benchmark only): every answer says so


@dataclass
class Choice:
    detok: IncrementalDetokenizer
    prefix: str = ""  # the echoed prompt
    prompt_last: int | None = None  # the prompt's last token: the answer's first logprob token is read after it
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    finish_reason: str | None = None
    last_time: float | None = None
    text_offset: int = 0
    cached_tokens: int = 0  # prompt tokens the prefix cache served (meta_info, on the finishing event)


class Generation:
    def __init__(self, ctx: ServerContext, request: CompletionRequest | ChatCompletionRequest,
                 inputs: list[list[int]], params: list[SamplingParams], start: float, echo: list[str] | None = None):
        self.ctx, self.request, self.inputs, self.params, self.start = ctx, request, inputs, params, start
        self.chat = isinstance(request, ChatCompletionRequest)
        self.want_logprobs = bool(request.logprobs is not None and request.logprobs is not False)
        n = request.num_choices
        self.choices = [Choice(IncrementalDetokenizer(ctx.tokenizer, p.stop or [], p.skip_special_tokens,
                                                      keep_stop=p.no_stop_trim, prompt_ids=inputs[i // n]))
                        for i, p in enumerate(params)]
        for i, c in enumerate(self.choices):
            c.prefix = echo[i // n] if echo else ""
            c.prompt_last = inputs[i // n][-1]
            c.text_offset = len(c.prefix)
        self.id = ("chatcmpl-" if self.chat else "cmpl-") + uuid.uuid4().hex
        self.created = int(time.time())
        self.rids: list[str] = []
        self.closed = False
        self._queue: asyncio.Queue[tuple[int, Event]] = asyncio.Queue()

    # ---- submission and events ----------------------------------------------------------------------------------
    async def submit(self) -> None:
        aloop = asyncio.get_running_loop()

        def sink(index: int, event: Event) -> None:  # engine thread -> this request's queue on the asyncio thread
            aloop.call_soon_threadsafe(self._queue.put_nowait, (index, event))

        sub = Submission(self.inputs_per_choice(), self.params, sink, self.request.user)
        try:
            self.rids = await asyncio.wrap_future(self.ctx.engine_loop.submit(sub))
        except ValueError as e:
            raise engine_error(e, "messages" if self.chat else "prompt") from None
        except QueueFull as e:
            raise APIError(503, str(e), None, "queue_full", "server_overloaded") from None
        except RuntimeError as e:
            loop = self.ctx.engine_loop
            if loop.alive and loop.failure is None:
                raise
            raise APIError(503, str(e), None, "engine_dead") from None  # the engine thread ended, or is ending
        self.ctx.metrics.requests_received.inc()

    def inputs_per_choice(self) -> list[list[int]]:
        n = self.request.num_choices
        return [self.inputs[i // n] for i in range(len(self.params))]

    def abort(self) -> None:
        """The client went away: abort the unfinished choices (their KV is freed before the next step)."""
        if self.closed:
            return
        self.closed = True
        live = [rid for rid, c in zip(self.rids, self.choices) if c.finish_reason is None]
        if live:
            self.ctx.engine_loop.abort(live)
            for _ in live:
                self.ctx.metrics.finished("abort")

    async def _events(self) -> AsyncIterator[tuple[int, str, Event]]:
        """(choice index, new text, event) until every choice has finished; a failed choice raises APIError(500)."""
        pending = sum(c.finish_reason is None for c in self.choices)
        while pending:
            index, event = await self._queue.get()
            c = self.choices[index]
            if event.error is not None:
                c.finish_reason = "error"
                self.ctx.metrics.finished("error")
                self.abort()  # this request's other choices: the answer cannot be completed
                raise APIError(500, f"internal server error: {event.error}", None, "internal_error")
            shown = event.text_ids if event.text_ids is not None else event.token_ids
            text = c.detok.push(shown, final=event.finished)
            self._observe(c, event)
            if event.finished:
                pending -= 1
                if pending == 0:
                    self.closed = True
            yield index, text, event

    def _observe(self, c: Choice, event: Event) -> None:
        m, k = self.ctx.metrics, len(event.token_ids)
        if k:
            if c.last_time is None:
                m.ttft.observe(event.time - self.start)
            else:
                m.itl.observe((event.time - c.last_time) / k, k)
            c.last_time = event.time
        c.token_ids += event.token_ids
        c.logprobs += event.logprobs
        if event.finished:
            c.finish_reason = event.finish_reason
            m.finished(event.finish_reason)
            m.e2e.observe(event.time - self.start)
            m.prompt_tokens.inc((event.meta or {}).get("prompt_tokens", 0))
            c.cached_tokens = (event.meta or {}).get("cached_tokens", 0)
            m.generation_tokens.inc(len(c.token_ids))

    # ---- non-streaming ------------------------------------------------------------------------------------------
    async def collect(self) -> dict:
        async for _ in self._events():
            pass
        choices = []
        for i, c in enumerate(self.choices):
            logprobs = self._logprobs(c, c.token_ids, c.logprobs) if self.want_logprobs else None
            row = {"index": i, "logprobs": logprobs, "finish_reason": c.finish_reason}
            if self.chat:
                row["message"] = {"role": "assistant", "content": c.detok.text}
            else:
                row["text"] = c.prefix + c.detok.text
            if self.ctx.tokenizer is None:  # --skip-tokenizer-init: no text, so the ids are the answer
                row["token_ids"] = c.token_ids
            choices.append(row)
        return self._envelope("chat.completion" if self.chat else "text_completion", choices, self._usage())

    # ---- streaming ----------------------------------------------------------------------------------------------
    async def stream(self) -> AsyncIterator[str]:
        """SSE lines; ends with `data: [DONE]`. A failure after the headers went out becomes an error event."""
        try:
            for i, c in enumerate(self.choices):
                if self.chat:
                    yield self._chunk(i, {"role": "assistant", "content": ""}, None, None)
                elif c.prefix:
                    yield self._chunk(i, c.prefix, None, None)
            async for i, text, event in self._events():
                c = self.choices[i]
                logprobs = self._logprobs(c, event.token_ids, event.logprobs) if self.want_logprobs else None
                ids = event.token_ids if self.ctx.tokenizer is None else None  # no text: the ids are the answer
                if text or ((logprobs or ids) and event.token_ids) or event.finished:
                    reason = event.finish_reason if event.finished else None
                    yield self._chunk(i, {"content": text} if self.chat else text, logprobs, reason, ids)
            if self.request.include_usage:
                yield _sse(self._envelope(self._chunk_object, [], self._usage()))
        except APIError as e:
            yield _sse(e.body())
        yield DONE

    @property
    def _chunk_object(self) -> str:
        return "chat.completion.chunk" if self.chat else "text_completion"

    def _chunk(self, index: int, delta, logprobs, finish_reason, token_ids: list[int] | None = None) -> str:
        row = {"index": index, "logprobs": logprobs, "finish_reason": finish_reason}
        row["delta" if self.chat else "text"] = delta
        if token_ids is not None:
            row["token_ids"] = token_ids
        return _sse(self._envelope(self._chunk_object, [row], None))

    # ---- shapes -------------------------------------------------------------------------------------------------
    def _envelope(self, obj: str, choices: list, usage: dict | None) -> dict:
        body = {"id": self.id, "object": obj, "created": self.created, "model": self.ctx.model_name,
                "choices": choices}
        if usage is not None:
            body["usage"] = usage
        if self.ctx.lossy:
            body["lossy_benchmark_mode"] = True
        return body

    def _usage(self) -> dict:
        prompt = sum(len(ids) for ids in self.inputs)
        completion = sum(len(c.token_ids) for c in self.choices)
        # each prompt counts once (as in prompt_tokens): the most any of its n choices found cached
        n = self.request.num_choices
        cached = sum(max(c.cached_tokens for c in self.choices[i:i + n]) for i in range(0, len(self.choices), n))
        return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
                "prompt_tokens_details": {"cached_tokens": cached}}

    def _logprobs(self, c: Choice, ids: list[int], values: list[float]) -> dict:
        tok = self.ctx.tokenizer
        earlier = len(c.token_ids) - len(ids)  # ids are c.token_ids' last (a stream event's) or all of them
        before = c.token_ids[earlier - 1] if earlier > 0 else c.prompt_last
        # without a tokenizer, vLLM's spelling of a token that has no text: "token_id:N"
        pieces = token_texts(tok, ids, before) if tok is not None and ids else [f"token_id:{t}" for t in ids]
        if self.chat:
            content = [{"token": p, "logprob": lp, "bytes": token_bytes(tok, t, p) if tok is not None else None,
                        "top_logprobs": []} for p, t, lp in zip(pieces, ids, _finite(values))]
            return {"content": content, "refusal": None}
        offsets = []
        for p in pieces:
            offsets.append(c.text_offset)
            c.text_offset += len(p)
        return {"tokens": pieces, "token_logprobs": _finite(values), "top_logprobs": None, "text_offset": offsets}


def _finite(logprobs: list[float]) -> list[float]:
    """JSON has no -inf or NaN: a token whose probability underflowed gets vLLM's floor instead."""
    return [lp if math.isfinite(lp) else LOGPROB_FLOOR for lp in logprobs]


def _sse(body: dict) -> str:
    return f"data: {json.dumps(body, ensure_ascii=False)}\n\n"
