"""Request models of the OpenAI API subset we serve, their validation, and OpenAI's error shape.

Requests are parsed strictly (no "5" -> 5 coercion), so a wrong type is a 400 naming the field, as is a value
out of range. Range checks mirror SamplingParams.validate, which the engine runs again as the backstop.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, ValidationError

from hyperdraft.sampling_params import REPETITION_PENALTY_RANGE, SamplingParams

MAX_N = 64  # choices per request: n samples of each prompt
# SamplingParams field -> the OpenAI request field a client set, for engine errors that name the former
ENGINE_TO_API_FIELD = {"max_new_tokens": "max_tokens", "return_logprob": "logprobs", "input_ids": "prompt"}


class APIError(Exception):
    """An error answered as {"error": {"message", "type", "param", "code"}} with an HTTP status."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 type: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.type = type or ("invalid_request_error" if status < 500 else "server_error")

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def _integral_float_to_int(value: Any) -> Any:
    """JSON has one number type: 60.0 is a valid integer to JSON Schema (and to clients that only have floats)."""
    return int(value) if isinstance(value, float) and value.is_integer() else value


# Strict otherwise: "5" is not 5, and 5.5 is not an integer.
JsonInt = Annotated[int, BeforeValidator(_integral_float_to_int)]


class _Model(BaseModel):
    # Unknown fields are ignored (clients send newer OpenAI fields); unsupported known ones are refused below.
    # Infinity and NaN (which Python's JSON reader accepts) are refused for every float field.
    model_config = ConfigDict(strict=True, extra="ignore", allow_inf_nan=False)


class StreamOptions(_Model):
    include_usage: bool = False


class _Sampling(_Model):
    """Fields shared by /v1/completions and /v1/chat/completions. None means "the default"."""

    model: str | None = None
    temperature: float | None = Field(None, ge=0)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: JsonInt | None = Field(None, ge=-1)
    min_p: float | None = Field(None, ge=0, le=1)
    frequency_penalty: float | None = Field(None, ge=-2, le=2)
    presence_penalty: float | None = Field(None, ge=-2, le=2)
    repetition_penalty: float | None = Field(None, ge=REPETITION_PENALTY_RANGE[0], le=REPETITION_PENALTY_RANGE[1])
    stop: str | list[str] | None = None
    stop_token_ids: list[JsonInt] | None = None
    seed: JsonInt | None = None
    n: JsonInt | None = Field(None, ge=1, le=MAX_N)
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    no_stop_trim: bool = False  # SGLang's: keep the matched stop string or stop token's text
    include_stop_str_in_output: bool | None = None  # vLLM's name for no_stop_trim
    stream: bool | None = None  # OpenAI's optional fields may be null: the default
    stream_options: StreamOptions | None = None
    user: str | None = None
    logit_bias: dict[str, float] | None = None
    # SGLang's and vLLM's output constraints, and min_tokens: named here only to be refused, since ignoring them
    # returns text that does not mean what the client asked for
    regex: Any = None
    json_schema: Any = None
    ebnf: Any = None
    structural_tag: Any = None
    guided_json: Any = None
    guided_regex: Any = None
    guided_choice: Any = None
    guided_grammar: Any = None
    min_tokens: Any = None
    # vLLM's fields that would change the output: refused by name when set (ignoring them answered 200 with text
    # that did not mean what was asked)
    allowed_token_ids: Any = None
    bad_words: Any = None
    use_beam_search: Any = None
    prompt_logprobs: Any = None

    def sampling_params(self, max_new_tokens: int, choice: int, logprobs: bool) -> SamplingParams:
        """The engine parameters of one choice. With a seed and n > 1, choice i uses seed + i, so the n samples
        differ (one shared seed would make them identical) and each stays reproducible."""
        stop = [self.stop] if isinstance(self.stop, str) else self.stop
        values = dict(temperature=self.temperature, top_p=self.top_p, top_k=self.top_k, min_p=self.min_p,
                      frequency_penalty=self.frequency_penalty, presence_penalty=self.presence_penalty,
                      repetition_penalty=self.repetition_penalty, stop_token_ids=self.stop_token_ids)
        values = {k: v for k, v in values.items() if v is not None}
        seed = None if self.seed is None else self.seed + choice
        return SamplingParams(max_new_tokens=max_new_tokens, stop=stop or None, seed=seed, ignore_eos=self.ignore_eos,
                              skip_special_tokens=self.skip_special_tokens,
                              no_stop_trim=self.no_stop_trim or bool(self.include_stop_str_in_output),
                              return_logprob=logprobs, **values)

    @property
    def num_choices(self) -> int:
        return self.n or 1

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    def check_supported(self) -> None:
        if self.logit_bias:
            raise unsupported("logit_bias")
        for name in CONSTRAINT_FIELDS:
            if getattr(self, name) is not None:
                raise unsupported(name, f"{name} is not supported by this server: output constraints are not "
                                        "implemented, and unconstrained text would not mean what was asked")
        if self.min_tokens not in (None, 0):
            raise unsupported("min_tokens", "min_tokens is not supported by this server (0 or omitted)")
        for name in VLLM_OUTPUT_FIELDS:
            value = getattr(self, name)
            if not (value is None or value is False or value == []):  # prompt_logprobs 0 still asks for them
                raise unsupported(name, f"{name} is not supported by this server (null or omitted)")
        if self.stream_options is not None and not self.stream:
            raise APIError(400, "stream_options is only allowed when stream is true", "stream_options", "invalid_value")
        if self.stop is not None and any(not s for s in ([self.stop] if isinstance(self.stop, str) else self.stop)):
            raise APIError(400, "stop strings must be non-empty", "stop", "invalid_value")
        if self.seed is not None and self.seed + self.num_choices - 1 >= 2**63:  # choice i samples with seed + i
            raise APIError(400, f"seed must be below 2**63 - {self.num_choices - 1} with n = {self.num_choices} "
                                f"(choice i uses seed + i), got {self.seed}", "seed", "invalid_value")


class CompletionRequest(_Sampling):
    prompt: str | list[str] | list[JsonInt] | list[list[JsonInt]]
    max_tokens: JsonInt | None = Field(None, ge=1)
    logprobs: JsonInt | None = Field(None, ge=0, le=5)
    echo: bool | None = None
    suffix: str | None = None
    best_of: JsonInt | None = Field(None, ge=1)

    def check_supported(self) -> None:
        super().check_supported()
        if self.suffix:
            raise unsupported("suffix")
        if self.best_of is not None and self.best_of != self.num_choices:
            raise unsupported("best_of", "best_of must equal n (or be omitted): choices are not ranked")
        if self.logprobs:
            raise unsupported("logprobs", "logprobs must be 0 or omitted: the engine returns the chosen token's "
                                          "logprob only, not the top alternatives")
        if self.echo and self.logprobs is not None:
            raise unsupported("echo", "echo with logprobs is not supported: prompt logprobs are not computed")

    def prompts(self) -> list[str] | list[list[int]]:
        """A list of text prompts or a list of token-id prompts."""
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if p and all(isinstance(x, int) for x in p):
            return [list(p)]
        if not p:
            raise APIError(400, "prompt is empty", "prompt", "invalid_value")
        return list(p)


class ContentPart(_Model):
    type: Literal["text"]  # images, audio, ...: the engine serves text models
    text: str


class ChatMessage(BaseModel):
    model_config = ConfigDict(strict=True, extra="allow")  # tool_calls, name, ...: handed to the chat template
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None

    def template_dict(self, index: int) -> dict:
        content = self.content
        if isinstance(content, list):
            content = "".join(part.text for part in content)
        return {**(self.model_extra or {}), "role": self.role, "content": content if content is not None else ""}

    def text(self) -> str:
        """What this message puts in front of the template, for the size limit (extra fields as their repr)."""
        content = self.content if isinstance(self.content, str) else "".join(
            part.text or "" for part in self.content or [])
        return content + (repr(self.model_extra) if self.model_extra else "")


class ResponseFormat(_Model):
    type: str


# apply_chat_template's own arguments, which the server sets: from chat_template_kwargs they clashed with its call
# ("got multiple values") or changed what it returns, and the error blamed the messages
SERVER_TEMPLATE_ARGUMENTS = frozenset({"conversation", "messages", "tokenize", "add_generation_prompt",
                                       "continue_final_message", "return_dict", "return_tensors", "padding",
                                       "truncation", "max_length", "return_assistant_tokens_mask", "tokenizer_kwargs"})


class ChatCompletionRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: JsonInt | None = Field(None, ge=1)
    max_completion_tokens: JsonInt | None = Field(None, ge=1)
    logprobs: bool | None = None
    top_logprobs: JsonInt | None = Field(None, ge=0, le=20)
    continue_final_message: Any = None  # vLLM's: refused when set (the answer would start a new message)
    tools: list[Any] | None = None
    tool_choice: Any = None
    functions: list[Any] | None = None
    function_call: Any = None
    response_format: ResponseFormat | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    chat_template: str | None = None  # vLLM's field; also accepted inside chat_template_kwargs

    def check_supported(self) -> None:
        super().check_supported()
        if self.top_logprobs:
            raise unsupported("top_logprobs", "top_logprobs must be 0 or omitted: the engine returns the chosen "
                                              "token's logprob only")
        if self.top_logprobs is not None and not self.logprobs:
            raise APIError(400, "top_logprobs needs logprobs=true", "top_logprobs", "invalid_value")
        if self.continue_final_message not in (None, False):
            raise unsupported("continue_final_message", "continue_final_message is not supported by this server "
                                                        "(false or omitted): answers start a new assistant message")
        if self.tools:
            raise unsupported("tools")
        if self.tool_choice not in (None, "none"):  # OpenAI refuses tool_choice without tools too
            raise unsupported("tool_choice", "tool_choice must be \"none\" or omitted: tools are not supported")
        for name in ("functions", "function_call"):  # the deprecated form of tools
            if getattr(self, name) is not None:
                raise unsupported(name)
        if self.response_format is not None and self.response_format.type != "text":
            raise unsupported("response_format", "response_format must be {\"type\": \"text\"}")
        clash = sorted(SERVER_TEMPLATE_ARGUMENTS.intersection(self.chat_template_kwargs or {}))
        if clash:
            raise APIError(400, f"chat_template_kwargs must not set {clash}: the server sets "
                                f"{sorted(SERVER_TEMPLATE_ARGUMENTS)} itself (the template's own variables, such as "
                                "enable_thinking, and chat_template are allowed)", "chat_template_kwargs",
                           "invalid_value")

    def client_chat_template(self) -> str | None:
        """A template the client sent instead of the model's, or None."""
        inner = (self.chat_template_kwargs or {}).get("chat_template")
        if inner is not None and not isinstance(inner, str):
            raise APIError(400, "chat_template_kwargs.chat_template must be a string", "chat_template", "invalid_type")
        return self.chat_template if self.chat_template is not None else inner

    @property
    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


VLLM_OUTPUT_FIELDS = ("allowed_token_ids", "bad_words", "use_beam_search", "prompt_logprobs")
CONSTRAINT_FIELDS = ("regex", "json_schema", "ebnf", "structural_tag", "guided_json", "guided_regex", "guided_choice",
                     "guided_grammar")


def unsupported(field: str, message: str | None = None) -> APIError:
    return APIError(400, message or f"{field} is not supported by this server", field, "unsupported_parameter")


def parse_request(model: type[_Model], body: bytes) -> Any:
    """Parse and validate a JSON body; every failure is an APIError(400) naming the field."""
    try:
        return model.model_validate_json(body)
    except ValidationError as e:
        raise _to_api_error(e) from None


def _to_api_error(e: ValidationError) -> APIError:
    # The deepest failure names the field best: in a union, the member that got furthest (a content part's type,
    # not "content is not a string").
    err = max(e.errors(include_url=False), key=lambda err: len(err["loc"]))
    kind, loc = err["type"], err["loc"]
    if kind == "json_invalid":
        return APIError(400, f"the request body is not valid JSON: {err['msg']}", None, "invalid_json")
    if not loc:
        return APIError(400, "the request body must be a JSON object", None, "invalid_type")
    param = _param(loc)
    if kind == "missing":
        return APIError(400, f"{param} is required", param, "missing_required_parameter")
    if param == "prompt":
        return APIError(400, "prompt must be a string, a list of strings, a list of token ids, or a list of "
                             "token-id lists", param, "invalid_type")
    got = err.get("input")
    got_text = "" if isinstance(got, (dict, list)) else f", got {got!r}"
    code = "invalid_value" if kind in _RANGE_ERRORS else "invalid_type"
    return APIError(400, f"{param}: {err['msg']}{got_text}", param, code)


_TYPE_TAGS = {"str", "int", "float", "bool", "none", "dict", "list"}
_RANGE_ERRORS = {"greater_than", "greater_than_equal", "less_than", "less_than_equal", "too_short", "too_long",
                 "finite_number", "literal_error"}


def _param(loc: tuple) -> str:
    """('messages', 0, 'content', 'str') -> 'messages[0].content'; pydantic's union-member tags are dropped."""
    out = str(loc[0])
    for part in loc[1:]:
        if isinstance(part, int):
            out += f"[{part}]"
        elif part.isidentifier() and part not in _TYPE_TAGS:
            out += f".{part}"
        else:
            break  # a union member tag such as 'list[int]': the field path ends here
    return out


def engine_error(e: ValueError, prompt_field: str) -> APIError:
    """An engine ValueError ("<field> must be ...", "prompt has N tokens ...") as a 400 naming the API field."""
    message = str(e)
    first = message.split(" ", 1)[0].strip(":,")
    if first in ("prompt", "input_ids"):
        too_long = "context length" in message or "max_total_tokens" in message
        return APIError(400, message, prompt_field, "context_length_exceeded" if too_long else "invalid_value")
    return APIError(400, message, ENGINE_TO_API_FIELD.get(first, first if first.isidentifier() else None),
                    "invalid_value")

