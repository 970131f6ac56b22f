"""Response models of the API, for /openapi.json and /docs.

The routes build their answers as plain dicts (generation.py) and do not re-validate them through these models
(that would cost every answer a second pass); the schemathesis test (tests/server/test_openapi.py) checks instead
that every answer conforms to the schema published here.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict


class _Response(BaseModel):
    model_config = ConfigDict(extra="forbid")


class ErrorBody(_Response):
    message: str
    type: str
    param: str | None
    code: str | None


class ErrorResponse(_Response):
    """OpenAI's error shape, for every 4xx and 5xx."""

    error: ErrorBody


class PromptTokensDetails(_Response):
    cached_tokens: int  # prompt tokens whose K/V came from the prefix cache


class Usage(_Response):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails | None = None


class CompletionLogprobs(_Response):
    tokens: list[str]
    token_logprobs: list[float]
    top_logprobs: None
    text_offset: list[int]


class CompletionChoice(_Response):
    index: int
    text: str
    logprobs: CompletionLogprobs | None
    finish_reason: str | None
    token_ids: list[int] | None = None  # only from a server without a tokenizer (--skip-tokenizer-init)


class CompletionResponse(_Response):
    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None
    lossy_benchmark_mode: bool | None = None  # present (true) only under simulated acceptance


class ChatLogprobToken(_Response):
    token: str
    logprob: float
    bytes: list[int] | None
    top_logprobs: list[Any]


class ChatLogprobs(_Response):
    content: list[ChatLogprobToken]
    refusal: None


class AssistantMessage(_Response):
    role: Literal["assistant"]
    content: str


class ChatChoice(_Response):
    index: int
    message: AssistantMessage
    logprobs: ChatLogprobs | None
    finish_reason: str | None
    token_ids: list[int] | None = None  # only from a server without a tokenizer (--skip-tokenizer-init)


class ChatCompletionResponse(_Response):
    id: str
    object: Literal["chat.completion"]
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage
    lossy_benchmark_mode: bool | None = None


class ModelCard(_Response):
    id: str
    object: Literal["model"]
    created: int
    owned_by: str
    max_model_len: int


class ModelList(_Response):
    object: Literal["list"]
    data: list[ModelCard]


class Health(_Response):
    status: Literal["ok"]


def documented(ok: type[BaseModel] | None, *errors: int, stream: bool = False) -> dict:
    """FastAPI's `responses=` for a route: its 200 model (or an SSE stream beside it) and its error statuses."""
    ok_doc: dict = {"description": "OK"}
    if ok is not None:
        ok_doc["model"] = ok
    if stream:  # stream=true answers with server-sent events of the same objects' chunks, then `data: [DONE]`
        event = {"type": "object", "required": ["data"],
                 "properties": {"data": {"type": "string", "description": "a JSON chunk, or [DONE] at the end"}}}
        ok_doc["content"] = {"text/event-stream": {"schema": event}}
    return {200: ok_doc, **{status: {"model": ErrorResponse, "description": _REASONS[status]} for status in errors}}


_REASONS = {400: "Bad request: the field is named in error.param", 401: "Missing or wrong API key",
            404: "Unknown model", 405: "Method not allowed", 413: "Request body too large",
            499: "Client closed the connection", 500: "Internal error of this request",
            503: "Engine down or queue full"}
