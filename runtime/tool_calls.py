"""Tool calls: OpenAI's `tools` and `tool_choice` on /v1/chat/completions.

- "none": the tools are not shown to the model; it answers in text.
- "auto" (the default when tools are given): the tools go into the prompt through the
  model's own chat template (templates that know tools: Qwen2.5, Hermes, Llama 3.1, ...)
  and the model decides. Calls written in the Hermes form those templates ask for,
  `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, come back as tool_calls, the
  text around them as content. Where the template ignores tools (the default model's),
  `hermes_messages` shows them in that form in the system message, with the conversation's
  earlier calls and results as Hermes blocks, so that the model can still call them.
- "required", or one named function: the output is constrained (runtime.structured_output),
  as vLLM does: for a named function, its arguments object (its parameters schema); for
  "required", a JSON array of {"name", "parameters"} objects, each one of the tools (one
  item when parallel_tool_calls is false). The calls then always parse and validate, and
  speculation stays lossless.

`ToolChoice.parse` turns a finished output into (content, calls); `ToolStream` holds a
streamed choice's text back while it may be a call, so streamed deltas carry the same
content and calls as the whole response.
"""
from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass

from runtime.sampling_params import GuidedSpec

CALL_OPEN, CALL_CLOSE = "<tool_call>", "</tool_call>"
HERMES_CALL = re.compile(re.escape(CALL_OPEN) + r"\s*(.*?)\s*" + re.escape(CALL_CLOSE), re.DOTALL)
ANY_ARGUMENTS = {"type": "object"}


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: str  # a JSON object, as OpenAI sends it
    id: str = ""

    def body(self, index: int | None = None) -> dict:
        call = {"id": self.id or f"call_{uuid.uuid4().hex[:24]}", "type": "function",
                "function": {"name": self.name, "arguments": self.arguments}}
        return call if index is None else {"index": index, **call}


@dataclass(frozen=True)
class ToolChoice:
    """What a request's tools and tool_choice ask of the model. tools: OpenAI's function
    definitions ({"name", "description", "parameters"}); mode: auto | required | named."""

    tools: tuple[dict, ...]
    mode: str
    name: str | None = None  # the function, when mode is named
    parallel: bool = True

    def constraint(self) -> GuidedSpec | None:
        """The grammar the output keeps to: none for auto."""
        if self.mode == "named":
            tool = next(t for t in self.tools if t["name"] == self.name)
            return GuidedSpec("json", tool.get("parameters") or ANY_ARGUMENTS)
        if self.mode == "required":
            calls = [{"type": "object", "properties": {"name": {"const": t["name"]},
                                                       "parameters": t.get("parameters") or ANY_ARGUMENTS},
                      "required": ["name", "parameters"], "additionalProperties": False} for t in self.tools]
            array = {"type": "array", "minItems": 1, "items": {"anyOf": calls}}
            return GuidedSpec("json", {**array, "maxItems": 1} if not self.parallel else array)
        return None

    def parse(self, text: str) -> tuple[str | None, list[ToolCall]]:
        """(content, calls) of a finished output."""
        if self.mode == "named":
            return None, [ToolCall(self.name, _compact(text))]
        if self.mode == "required":
            try:
                items = json.loads(text)
            except ValueError:  # cut short by max_tokens: no call to report
                return text, []
            return None, [ToolCall(item["name"], json.dumps(item["parameters"], ensure_ascii=False)) for item in items]
        calls = []
        for match in HERMES_CALL.finditer(text):
            call = _hermes_call(match.group(1))
            if call is not None:
                calls.append(call)
        if not calls:
            return text, []
        content = HERMES_CALL.sub("", text).strip()
        return content or None, calls


TOOLS_INSTRUCTIONS = ("You may call functions to help with the request. Each is described by a JSON object "
                      "between <tools> and </tools>:")
CALL_INSTRUCTIONS = ("To call one, write <tool_call>{\"name\": the function's name, \"arguments\": a JSON object "
                     "of its arguments}</tool_call>, one block per call. Otherwise answer in text.")


def hermes_messages(messages: list[dict], tools: list[dict]) -> list[dict]:
    """messages for a chat template that ignores tools: the tools (OpenAI's {"type":
    "function", "function": {...}}) described in the system message, in the Hermes form that
    ToolChoice.parse reads back; an assistant's earlier calls as <tool_call> blocks, and tool
    results as <tool_response> blocks from the user."""
    listing = "\n".join([TOOLS_INSTRUCTIONS, "<tools>", *(json.dumps(t, ensure_ascii=False) for t in tools),
                         "</tools>", CALL_INSTRUCTIONS])
    out = []
    for message in messages:
        if message["role"] == "assistant" and message.get("tool_calls"):
            calls = [CALL_OPEN + json.dumps({"name": c["function"]["name"], "arguments": c["function"]["arguments"]},
                                            ensure_ascii=False) + CALL_CLOSE for c in message["tool_calls"]]
            out.append({"role": "assistant", "content": "\n".join([message.get("content") or "", *calls]).strip()})
        elif message["role"] == "tool":
            out.append({"role": "user", "content": f"<tool_response>\n{message['content']}\n</tool_response>"})
        else:
            out.append(dict(message))
    if out and out[0]["role"] == "system":
        out[0]["content"] = f"{out[0]['content']}\n\n{listing}"
    else:
        out.insert(0, {"role": "system", "content": listing})
    return out


def _compact(text: str) -> str:
    try:
        return json.dumps(json.loads(text), ensure_ascii=False)
    except ValueError:
        return text


def _hermes_call(body: str) -> ToolCall | None:
    try:
        call = json.loads(body)
    except ValueError:
        return None
    if not isinstance(call, dict) or not isinstance(call.get("name"), str):
        return None
    arguments = call.get("arguments", call.get("parameters", {}))
    return ToolCall(call["name"], arguments if isinstance(arguments, str) else json.dumps(arguments,
                                                                                          ensure_ascii=False))


class ToolStream:
    """One streamed choice's text under a ToolChoice: `content(delta)` -> the content that
    may go out now (auto: text until a call may have begun; constrained: none), `finish()`
    -> (the content held back, the calls)."""

    def __init__(self, choice: ToolChoice):
        self.choice, self.text, self.sent = choice, "", 0

    def content(self, delta: str) -> str:
        self.text += delta
        if self.choice.mode != "auto":
            return ""
        start = self.text.find(CALL_OPEN)
        safe = start if start != -1 else len(self.text) - _partial_suffix(self.text, CALL_OPEN)
        out, self.sent = self.text[self.sent:max(safe, self.sent)], max(safe, self.sent)
        return out

    def finish(self) -> tuple[str, list[ToolCall]]:
        content, calls = self.choice.parse(self.text)
        if not calls:
            return self.text[self.sent:], []
        rest = (content or "")[self.sent:] if content and content.startswith(self.text[:self.sent]) else ""
        return rest, calls


def _partial_suffix(text: str, marker: str) -> int:
    """The length of the longest suffix of text that begins marker (held back: it may grow into it)."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0
