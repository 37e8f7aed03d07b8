"""Tool calls (runtime.tool_calls): the constraint each tool_choice sets, parsing finished
outputs (Hermes calls for auto, constrained JSON for required and named), streaming that
holds back exactly what may still become a call, and the tools in the prompt: a template's
own rendering where it knows tools, else the Hermes form that auto parses back (the default
model's real template)."""
from __future__ import annotations

import json

import jsonschema
import pytest

from runtime.prompts import chat_text
from runtime.tool_calls import ToolCall, ToolChoice, ToolStream

WEATHER = {"name": "get_weather", "description": "Weather in a city",
           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}
TIME = {"name": "get_time", "parameters": {"type": "object", "properties": {"zone": {"type": "string"}}}}
TOOLS = (WEATHER, TIME)


def test_named_and_required_constraints_accept_exactly_calls_of_the_tools():
    named = ToolChoice(TOOLS, "named", "get_weather").constraint()
    assert named.kind == "json" and named.value == WEATHER["parameters"]
    required = ToolChoice(TOOLS, "required").constraint().value
    jsonschema.validate([{"name": "get_time", "parameters": {"zone": "UTC"}},
                         {"name": "get_weather", "parameters": {"city": "Oslo"}}], required)
    for wrong in ([], [{"name": "get_weather", "parameters": {}}], [{"name": "other", "parameters": {}}]):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(wrong, required)
    single = ToolChoice(TOOLS, "required", parallel=False).constraint().value
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate([{"name": "get_time", "parameters": {}}] * 2, single)
    assert ToolChoice(TOOLS, "auto").constraint() is None


def test_parsing_finished_outputs():
    content, calls = ToolChoice(TOOLS, "named", "get_weather").parse('{"city":  "Oslo"}')
    assert content is None and [(c.name, json.loads(c.arguments)) for c in calls] == [("get_weather", {"city": "Oslo"})]
    content, calls = ToolChoice(TOOLS, "required").parse(
        '[{"name": "get_time", "parameters": {"zone": "CET"}}, '
        '{"name": "get_weather", "parameters": {"city": "Rome"}}]')
    assert content is None and [c.name for c in calls] == ["get_time", "get_weather"]
    assert json.loads(calls[1].arguments) == {"city": "Rome"}
    text = ('Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
            '<tool_call>{"name": "get_time", "arguments": "{\\"zone\\": \\"CET\\"}"}</tool_call>')
    content, calls = ToolChoice(TOOLS, "auto").parse(text)
    assert content == "Let me check." and [c.name for c in calls] == ["get_weather", "get_time"]
    assert json.loads(calls[0].arguments) == {"city": "Paris"} and json.loads(calls[1].arguments) == {"zone": "CET"}
    assert ToolChoice(TOOLS, "auto").parse("It is sunny.") == ("It is sunny.", [])
    assert ToolChoice(TOOLS, "auto").parse("<tool_call>not json</tool_call>")[1] == []
    body = calls[0].body(0)
    assert body["index"] == 0 and body["type"] == "function" and body["id"].startswith("call_")


@pytest.mark.parametrize("text", [
    "Plain answer, no call at all.",
    "Let me look. <tool_call>\n" + json.dumps({"name": "get_weather", "arguments": {"city": "Oslo"}})
    + "\n</tool_call>",
    "<tool_call>" + json.dumps({"name": "get_time", "arguments": {}}) + "</tool_call>",
    "Text with a < sign and <tool_ that never becomes a call.",
])
@pytest.mark.parametrize("step", [1, 3, 7])
def test_streamed_deltas_carry_what_the_whole_output_says(text, step):
    choice = ToolChoice(TOOLS, "auto")
    stream = ToolStream(choice)
    sent = "".join(stream.content(text[i:i + step]) for i in range(0, len(text), step))
    rest, calls = stream.finish()
    content, expected_calls = choice.parse(text)
    assert [(c.name, c.arguments) for c in calls] == [(c.name, c.arguments) for c in expected_calls]
    if expected_calls:
        assert (sent + rest).strip() == (content or "")
        assert "<tool_call>" not in sent
    else:
        assert sent + rest == text


def test_constrained_streams_send_nothing_until_the_end():
    stream = ToolStream(ToolChoice(TOOLS, "named", "get_time"))
    assert stream.content('{"zone": ') == "" and stream.content('"UTC"}') == ""
    rest, calls = stream.finish()
    assert rest == "" and calls[0].name == "get_time" and json.loads(calls[0].arguments) == {"zone": "UTC"}


class Template:
    """A chat template that renders tools, or ignores them."""

    def __init__(self, knows_tools: bool):
        self.knows_tools, self.renders = knows_tools, 0

    def apply_chat_template(self, messages, tools=None, tokenize=False, add_generation_prompt=True):
        self.renders += 1
        head = f"TOOLS {len(tools)}\n" if tools and self.knows_tools else ""
        return head + "".join(f"{m['role']}: {m['content']}\n" for m in messages)


def test_a_template_that_knows_tools_renders_them_its_own_way():
    messages = [{"role": "user", "content": "Hi"}]
    assert chat_text(Template(True), messages, [{"type": "function", "function": WEATHER}]) == "TOOLS 1\nuser: Hi\n"
    assert chat_text(Template(False), messages, None) == "user: Hi\n"
    ignored = chat_text(Template(False), [{"role": "system", "content": "Be brief."}] + messages,
                        [{"type": "function", "function": WEATHER}])
    assert ignored.startswith("system: Be brief.\n\nYou may call functions") and ignored.endswith("user: Hi\n")


def test_whether_a_template_renders_tools_is_asked_once_per_tokenizer():
    template, tools = Template(False), [{"type": "function", "function": WEATHER}]
    chat_text(template, [{"role": "user", "content": "Hi"}], tools)
    asked = template.renders
    chat_text(template, [{"role": "user", "content": "Hello"}], tools)
    assert asked == 3 and template.renders == asked + 1  # the probe's two renders, then one a request


def test_a_template_that_ignores_tools_gets_them_in_the_form_auto_parses(engine_f32):
    """The default model's template ignores tools: they go into a system message, the earlier
    calls and results as Hermes blocks; the call form it asks for parses back as a call."""
    tokenizer, tools = engine_f32.tokenizer, [{"type": "function", "function": WEATHER}]
    call = {"name": "get_weather", "arguments": {"city": "Oslo"}}
    messages = [{"role": "user", "content": "Weather in Oslo?"},
                {"role": "assistant", "content": "",
                 "tool_calls": [{"id": "c1", "type": "function", "function": call}]},
                {"role": "tool", "tool_call_id": "c1", "content": "5 C"}]
    assert tokenizer.apply_chat_template(messages[:1], tools=tools, tokenize=False) == \
        tokenizer.apply_chat_template(messages[:1], tokenize=False)  # it ignores them
    text = chat_text(tokenizer, messages, tools)
    assert "<tools>\n" + json.dumps(tools[0]) + "\n</tools>" in text
    block = "<tool_call>" + json.dumps(call) + "</tool_call>"
    assert block in text and "<tool_response>\n5 C\n</tool_response>" in text
    assert text.index("<tools>") < text.index("Weather in Oslo?") < text.index(block) < text.index("5 C")
    assert ToolChoice(TOOLS, "auto").parse(block) == (None, [ToolCall("get_weather", '{"city": "Oslo"}')])
