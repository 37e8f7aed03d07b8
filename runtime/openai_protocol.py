"""The OpenAI wire format's requests: the bodies of /v1/completions and /v1/chat/completions,
their conversion to SamplingParams, and the error body (the responses and stream chunks:
runtime.openai_responses).

Both endpoints take n (choices sampled per prompt; choice i of a seeded request uses
seed + i), stream (SSE `data: {...}` chunks, then `data: [DONE]`),
stream_options.include_usage (a last chunk with usage and no choices), max_tokens (chat
also max_completion_tokens), temperature, top_p, seed, stop, logprobs (completions: the
number of most likely tokens to list; chat: a bool, with top_logprobs), user, and the
extensions top_k, ignore_eos, stop_token_ids, include_stop_str_in_output and
`speculation` (this request's proposer: {"method": "lookahead", "num_speculative_tokens":
4}, or "off"). Values must have the JSON type OpenAI's API asks for (16, not "16"; 1, not
true), as OpenAI checks them. Unknown fields are ignored, as vLLM does. OpenAI fields that change the
output and are not implemented here (presence_penalty, frequency_penalty, logit_bias;
completions also echo, suffix and best_of) are a 400 naming the field unless they hold
their no-op value (0, {}, false, "", or best_of 1 or n): never an output that silently
differs from what was asked.

Structured output (runtime.structured_output): OpenAI's response_format ({"type":
"json_object"}, or "json_schema" with {"name", "schema", "strict"}), and vLLM's guided_json,
guided_regex, guided_choice and guided_grammar (EBNF) on both endpoints; at most one of them.
A schema or grammar that does not compile is a 400 naming it. Chat also takes tools,
tool_choice and parallel_tool_calls (runtime.tool_calls); earlier turns may hold assistant
tool_calls and tool messages.

max_tokens when absent: 16 for completions (OpenAI's default on that endpoint); for
chat, all the context the prompt leaves (max_model_len - prompt tokens), as OpenAI and
vLLM do. A prompt plus max_tokens beyond max_model_len is refused, not truncated.

Bad input raises ApiError, whose body is OpenAI's {"error": {"message", "type":
"invalid_request_error", "param", "code"}}. Nothing here knows about HTTP or the engine loop.
"""
from __future__ import annotations

import json
from typing import ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictFloat, StrictInt, model_validator

from runtime.sampling_params import MAX_LOGPROBS, GuidedSpec, SamplingParams
from runtime.tool_calls import ToolChoice
from speculators import registry

MAX_N = 16  # choices per request


# ---- errors -------------------------------------------------------------------------------------

class ApiError(Exception):
    """A request the server refuses, with the HTTP status and OpenAI error fields to send."""

    def __init__(self, message: str, param: str | None = None, status: int = 400,
                 type: str = "invalid_request_error", code: str | None = None, headers: dict | None = None):
        super().__init__(message)
        self.message, self.param, self.status, self.type, self.code = message, param, status, type, code
        self.headers = headers

    def body(self) -> dict:
        return error_body(self.message, self.type, self.param, self.code)


def error_body(message: str, type: str, param: str | None = None, code: str | None = None) -> dict:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


def validation_error(errors: list[dict]) -> ApiError:
    """The ApiError for pydantic's (non-empty) list of errors in a request body."""
    if errors[0].get("type") == "json_invalid":
        return ApiError(f"the request body is not valid JSON ({errors[0].get('ctx', {}).get('error', 'parse error')})")
    message = "; ".join(f"{_loc(e)}: {e.get('msg')}" for e in errors[:3])
    return ApiError(message, _loc(errors[0]).split(".")[0])


def _loc(error: dict) -> str:
    """'messages.0.content' from ('body', 'messages', 0, 'content')."""
    return ".".join(str(part) for part in error.get("loc", ())[1:]) or "body"


# ---- request bodies -----------------------------------------------------------------------------

class StreamOptions(BaseModel):
    include_usage: StrictBool = False


class SpeculationOptions(BaseModel):
    """The `speculation` extension: which proposer drafts for this request, and how much."""

    model_config = ConfigDict(extra="forbid")  # a misspelt setting is an error, not silently ignored

    method: str
    num_speculative_tokens: StrictInt | None = None


class JsonSchemaFormat(BaseModel):
    name: str | None = None
    description: str | None = None
    schema_: dict | None = Field(None, alias="schema")
    strict: StrictBool | None = None


class ResponseFormat(BaseModel):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class GenerationRequest(BaseModel):
    """Fields both endpoints share; anything else in the body is ignored."""

    prompt_param: ClassVar[str]  # the field that holds the prompt, as errors name it
    default_max_tokens: ClassVar[int | None]  # None: all the context the prompt leaves

    model: str | None = None
    max_tokens: StrictInt | None = None
    temperature: StrictFloat | None = None
    top_p: StrictFloat | None = None
    top_k: StrictInt | None = None
    seed: StrictInt | None = None
    stop: str | list[str] | None = None
    stream: StrictBool | None = False
    stream_options: StreamOptions | None = None
    n: StrictInt | None = 1
    user: str | None = None
    ignore_eos: StrictBool = False
    stop_token_ids: list[StrictInt] | None = None
    include_stop_str_in_output: StrictBool = False
    speculation: SpeculationOptions | Literal["off"] | None = None
    response_format: ResponseFormat | None = None
    guided_json: dict | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    # not implemented: refused unless None or the value that changes nothing (no_op_values)
    presence_penalty: StrictFloat | None = None
    frequency_penalty: StrictFloat | None = None
    logit_bias: dict[str, float] | None = None
    no_op_values: ClassVar[dict] = {"presence_penalty": 0, "frequency_penalty": 0, "logit_bias": {}}

    @property
    def include_usage(self) -> bool:
        return bool(self.stream and self.stream_options and self.stream_options.include_usage)

    @property
    def requested_max_tokens(self) -> int | None:
        return self.max_tokens

    @property
    def num_choices(self) -> int:
        return 1 if self.n is None else self.n

    @property
    def num_logprobs(self) -> int | None:
        """Most likely tokens to list per position; None: no logprobs."""
        raise NotImplementedError

    def check(self, served_model_name: str) -> None:
        """Refuse a request for another model, or for too many choices."""
        if self.model and self.model != served_model_name:
            raise ApiError(f"the model {self.model!r} does not exist; this server serves {served_model_name!r}",
                           "model", status=404, code="model_not_found")
        if not 1 <= self.num_choices <= MAX_N:
            raise ApiError(f"n must be from 1 to {MAX_N}, got {self.n}", "n")
        for name, no_op in self.no_op_values.items():
            value = getattr(self, name)
            if value is not None and value != no_op:
                raise ApiError(f"{name} is not supported by this server; leave it out (or send {json.dumps(no_op)})",
                               name)

    def sampling_params(self, num_prompt_tokens: int, max_model_len: int) -> list[SamplingParams]:
        """One SamplingParams per choice (SamplingParams.choices: choice i of a seeded request has seed + i)."""
        max_tokens = self._max_tokens(num_prompt_tokens, max_model_len)
        speculator, num_speculative_tokens = self._speculation()
        guided = self.guided()
        try:
            return SamplingParams(
                max_tokens=max_tokens, temperature=1.0 if self.temperature is None else self.temperature,
                top_p=1.0 if self.top_p is None else self.top_p, top_k=self.top_k or 0, seed=self.seed,
                stop=self.stop or [], stop_token_ids=self.stop_token_ids or [], ignore_eos=self.ignore_eos,
                include_stop_str_in_output=self.include_stop_str_in_output, logprobs=self.num_logprobs,
                speculator=speculator, num_speculative_tokens=num_speculative_tokens, guided=guided,
                n=self.num_choices).choices()
        except ValueError as e:  # SamplingParams' messages start with the field's name
            raise ApiError(str(e), str(e).split()[0]) from None

    def _speculation(self) -> tuple[str | None, int | None]:
        """(speculator, draft tokens) of the `speculation` extension; (None, None): the server's."""
        options = self.speculation
        if options is None:
            return None, None
        if options == "off":
            return "none", None
        try:
            registry.check_name(options.method)
        except ValueError:
            raise ApiError(f"speculation.method must be one of {', '.join(registry.names())} or several of them joined by "
                           f"'+' (e.g. eagle+lookahead), got {options.method!r}", "speculation") from None
        tokens = options.num_speculative_tokens
        if tokens is not None and not 0 <= tokens <= 64:
            raise ApiError(f"speculation.num_speculative_tokens must be from 0 to 64, got {tokens}", "speculation")
        return options.method, tokens

    def _constraints(self) -> dict:
        """The fields that ask for structured output, by name."""
        asked = {name: getattr(self, name) for name in ("guided_json", "guided_regex", "guided_choice",
                                                         "guided_grammar")
                 if getattr(self, name) is not None}
        fmt = self.response_format
        if fmt is not None and fmt.type != "text":
            asked["response_format"] = fmt
        return asked

    @property
    def constraint_param(self) -> str | None:
        """The field that asks for structured output (errors name it); None: free text."""
        return next(iter(self._constraints()), None)

    def guided(self) -> GuidedSpec | None:
        """The constraint asked for by response_format or one guided_* field; None: free text."""
        asked = self._constraints()
        if len(asked) > 1:
            raise ApiError(f"ask for one kind of structured output, not {' and '.join(asked)}", list(asked)[1])
        if not asked:
            return None
        (param, value), = asked.items()
        if param == "response_format":
            if value.type == "json_object":
                return GuidedSpec("json_object")
            if value.json_schema is None or value.json_schema.schema_ is None:
                raise ApiError("response_format json_schema needs json_schema.schema", "response_format")
            return GuidedSpec("json", value.json_schema.schema_)
        try:
            return GuidedSpec(param.removeprefix("guided_"), value)
        except ValueError as e:
            raise ApiError(f"{param}: {e}", param) from None

    def _max_tokens(self, num_prompt_tokens: int, max_model_len: int) -> int:
        """The requested max tokens, if the context has room for them; else the default."""
        requested, room, param = self.requested_max_tokens, max_model_len - num_prompt_tokens, self.prompt_param
        if requested is None:
            return room if self.default_max_tokens is None else min(self.default_max_tokens, room)
        if requested > room:
            raise ApiError(f"this model's maximum context length is {max_model_len} tokens, but "
                           f"{num_prompt_tokens + requested} were requested ({num_prompt_tokens} in the {param}, "
                           f"{requested} for the completion); reduce the {param} or max_tokens", "max_tokens")
        return requested


class CompletionRequest(GenerationRequest):
    prompt_param: ClassVar[str] = "prompt"
    default_max_tokens: ClassVar[int | None] = 16

    prompt: str | list[int] | list[str] | list[list[int]]
    logprobs: StrictInt | None = None
    echo: StrictBool | None = None  # not implemented, as best_of and suffix
    suffix: str | None = None
    best_of: StrictInt | None = None
    no_op_values: ClassVar[dict] = {**GenerationRequest.no_op_values, "echo": False, "suffix": ""}

    def check(self, served_model_name: str) -> None:
        super().check(served_model_name)
        if self.best_of not in (None, 1, self.num_choices):  # best_of == n samples n and keeps them all
            raise ApiError("best_of is not supported by this server; leave it out (or send 1, or n)", "best_of")

    @property
    def num_logprobs(self) -> int | None:
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_LOGPROBS:
            raise ApiError(f"logprobs must be from 0 to {MAX_LOGPROBS}, got {self.logprobs}", "logprobs")
        return self.logprobs

    def to_prompt(self) -> str | list[int]:
        """The one prompt of the request: a batch of prompts is refused unless it holds one."""
        prompt = self.prompt
        if isinstance(prompt, str) or not prompt or isinstance(prompt[0], int):
            return prompt
        if len(prompt) != 1:
            raise ApiError(f"one prompt per request is supported, got {len(prompt)}; send them as separate "
                           "requests (they are batched together anyway)", "prompt")
        return prompt[0]


class ContentPart(BaseModel):
    type: str
    text: str | None = None


class FunctionCall(BaseModel):
    name: str
    arguments: str  # a JSON object


class MessageToolCall(BaseModel):
    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(BaseModel):
    role: Literal["system", "developer", "user", "assistant", "tool", "function"]
    content: str | list[ContentPart] | None = None
    tool_calls: list[MessageToolCall] | None = None  # an assistant's earlier calls
    tool_call_id: str | None = None  # a tool's answer: to which call
    name: str | None = None

    @model_validator(mode="after")
    def _content_required(self) -> "ChatMessage":
        """OpenAI's rule: only an assistant's message (one that called tools) may come without content."""
        if self.content is None and self.role != "assistant":
            raise ValueError(f"a {self.role} message needs 'content'")
        return self

    def for_template(self) -> dict:
        """As chat templates take it: "developer" is "system"; calls' arguments as objects."""
        message = {"role": "system" if self.role == "developer" else self.role, "content": self.text()}
        if self.tool_calls:
            message["tool_calls"] = [{"id": call.id, "type": "function",
                                      "function": {"name": call.function.name,
                                                   "arguments": _json_object(call.function.arguments)}}
                                     for call in self.tool_calls]
        if self.tool_call_id is not None:
            message["tool_call_id"] = self.tool_call_id
        if self.name is not None:
            message["name"] = self.name
        return message

    def text(self) -> str:
        if self.content is None or isinstance(self.content, str):
            return self.content or ""
        if any(part.type != "text" or part.text is None for part in self.content):
            raise ApiError("only text content parts are supported", "messages")
        return "".join(part.text for part in self.content)


def _json_object(text: str):
    try:
        return json.loads(text)
    except ValueError:
        return text


class FunctionDefinition(BaseModel):
    name: str
    description: str | None = None
    parameters: dict | None = None
    strict: StrictBool | None = None


class Tool(BaseModel):
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(BaseModel):
    name: str


class NamedToolChoice(BaseModel):
    type: Literal["function"]
    function: NamedFunction


class ChatCompletionRequest(GenerationRequest):
    prompt_param: ClassVar[str] = "messages"
    default_max_tokens: ClassVar[int | None] = None

    messages: list[ChatMessage]
    max_completion_tokens: StrictInt | None = None
    logprobs: StrictBool | None = False
    top_logprobs: StrictInt | None = None
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: StrictBool | None = None

    def tool_use(self) -> ToolChoice | None:
        """What the tools and tool_choice ask for; None: answer in text."""
        choice = self.tool_choice
        if not self.tools:
            if choice not in (None, "none"):
                raise ApiError("tool_choice needs tools", "tool_choice")
            return None
        if choice == "none":
            return None
        tools = tuple(t.function.model_dump(exclude_none=True) for t in self.tools)
        parallel = self.parallel_tool_calls is not False
        if isinstance(choice, NamedToolChoice):
            if choice.function.name not in {t["name"] for t in tools}:
                raise ApiError(f"tool_choice names the function {choice.function.name!r}, which is not among the "
                               f"tools", "tool_choice")
            return ToolChoice(tools, "named", choice.function.name, parallel)
        return ToolChoice(tools, choice or "auto", None, parallel)

    def guided(self) -> GuidedSpec | None:
        tool_spec = (use := self.tool_use()) and use.constraint()
        if tool_spec is None:
            return super().guided()
        if super().guided() is not None:
            raise ApiError("tool_choice required or a named function constrains the output already; do not also "
                           "ask for response_format or guided_*", "tool_choice")
        return tool_spec

    @property
    def num_logprobs(self) -> int | None:
        if self.top_logprobs is not None and not 0 <= self.top_logprobs <= MAX_LOGPROBS:
            raise ApiError(f"top_logprobs must be from 0 to {MAX_LOGPROBS}, got {self.top_logprobs}", "top_logprobs")
        if self.top_logprobs and not self.logprobs:
            raise ApiError("top_logprobs needs logprobs: true", "top_logprobs")
        return (self.top_logprobs or 0) if self.logprobs else None

    @property
    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def to_prompt(self) -> list[dict] | dict:
        """The messages as the engine's chat template takes them, with the tools when the
        model may call them (runtime.prompts)."""
        messages = [m.for_template() for m in self.messages]
        use = self.tool_use()
        return messages if use is None else {"messages": messages, "tools": [
            {"type": "function", "function": tool} for tool in use.tools]}
