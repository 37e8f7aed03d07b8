"""Structured output over HTTP, driven by the `openai` SDK (runtime.openai_protocol,
runtime.structured_output):

- the SDK's own structured-output helper, `client.chat.completions.parse` with a pydantic
  model, gets an instance back, with and without speculation, streamed and not;
- `response_format` json_object, and vLLM's guided_choice / guided_regex / guided_grammar /
  guided_json on both endpoints;
- a schema or grammar that does not compile, two kinds of constraint at once, and a bad
  guided_* value are 400s with OpenAI's error body, and the server goes on;
- tools: a named function and "required" give tool_calls whose arguments validate, streamed
  (the SDK's accumulated deltas) and not, with and without speculation; "auto" answers in
  text when the model does (the default model's template ignores tools, which then go into
  the system message in the Hermes form, and the 135M model does not call them), and a
  Hermes call in the output (forced here by a grammar) comes back as tool_calls; earlier
  turns with assistant tool_calls and tool messages are taken; bad tool_choice 400s;
- a request's grammar compiles on a worker thread, not on the engine's loop.
"""
from __future__ import annotations

import json
import re
import threading

import httpx
import pytest
from pydantic import BaseModel

openai = pytest.importorskip("openai")
pytest.importorskip("uvicorn")

from tests.server.test_server import serving_engine  # noqa: E402
from tests.server.test_server_api import MODEL, client, make_engine  # noqa: E402

EXTRACT = [{"role": "user", "content": "Extract the person: Maria Lopez, 34, is a nurse in Madrid. Reply in JSON."}]


class Person(BaseModel):
    name: str
    age: int
    city: str


@pytest.fixture(scope="module")
def server():
    engine = make_engine(max_num_seqs=8)
    with serving_engine(engine) as base_url:
        yield base_url, engine


@pytest.mark.parametrize("speculation", [None, {"method": "lookahead"}])
def test_the_sdks_parse_helper_gets_a_pydantic_instance(server, speculation):
    c = client(server[0])
    extra = {"speculation": speculation} if speculation else None
    completion = c.chat.completions.parse(model=MODEL, messages=EXTRACT, response_format=Person, temperature=0,
                                          max_tokens=80, extra_body=extra)
    message = completion.choices[0].message
    assert completion.choices[0].finish_reason == "stop"
    assert isinstance(message.parsed, Person) and message.parsed.age == 34, message.content


def test_streamed_json_schema_deltas_join_into_valid_json(server):
    c = client(server[0])
    schema = Person.model_json_schema()
    stream = c.chat.completions.create(model=MODEL, messages=EXTRACT, temperature=0, max_tokens=80, stream=True,
                                       response_format={"type": "json_schema",
                                                        "json_schema": {"name": "person", "schema": schema,
                                                                        "strict": True}})
    text = "".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices)
    Person.model_validate_json(text)


def test_json_object_and_guided_fields_on_both_endpoints(server):
    c = client(server[0])
    chat = c.chat.completions.create(model=MODEL, messages=EXTRACT, temperature=0, max_tokens=60,
                                     response_format={"type": "json_object"})
    assert chat.choices[0].message.content.startswith("{")
    choice = c.completions.create(model=MODEL, prompt="Is Madrid in Spain? Answer:", max_tokens=5, temperature=0,
                                  extra_body={"guided_choice": ["yes", "no"]})
    assert choice.choices[0].text in ("yes", "no")
    regex = c.completions.create(model=MODEL, prompt="Maria's phone number is", max_tokens=20, temperature=0.7,
                                 seed=1, extra_body={"guided_regex": r" \d{3}-\d{4}"})
    assert re.fullmatch(r" \d{3}-\d{4}", regex.choices[0].text)
    grammar = c.chat.completions.create(model=MODEL, messages=EXTRACT, temperature=0, max_tokens=30,
                                        extra_body={"guided_grammar": 'root ::= "Age: " [0-9]+'})
    assert re.fullmatch(r"Age: [0-9]+", grammar.choices[0].message.content)
    guided_json = c.chat.completions.create(model=MODEL, messages=EXTRACT, temperature=0, max_tokens=80,
                                            extra_body={"guided_json": Person.model_json_schema()})
    Person.model_validate_json(guided_json.choices[0].message.content)


@pytest.mark.parametrize("body, param, message", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nonsense"}}}},
     "response_format", "JSON schema does not compile"),
    ({"guided_regex": "(abc"}, "guided_regex", "regex does not compile"),
    ({"guided_grammar": 'root ::= "a" |'}, "guided_grammar", "grammar does not compile"),
    # no token of SmolLM2's vocabulary (as xgrammar reads it) begins U+40000 (found by fuzzing)
    ({"guided_regex": "\U00040000"}, "guided_regex", "no token of its vocabulary can begin one"),
    ({"guided_choice": ["yes"], "guided_regex": "y"}, "guided_choice", "not guided_regex and guided_choice"),
    ({"guided_choice": []}, "guided_choice", "guided_choice: guided choice needs"),
    ({"response_format": {"type": "json_schema"}}, "response_format", "needs json_schema.schema"),
    ({"response_format": {"type": "xml"}}, "response_format", "response_format"),
])
def test_bad_constraints_are_400s_and_the_server_goes_on(server, body, param, message):
    base_url = server[0]
    r = httpx.post(f"{base_url}/v1/chat/completions", json={"model": MODEL, "messages": EXTRACT, "max_tokens": 5,
                                                            **body}, timeout=60)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert message in error["message"] and error["type"] == "invalid_request_error", error
    assert error["param"] == param
    ok = httpx.post(f"{base_url}/v1/completions", json={"model": MODEL, "prompt": "Hi", "max_tokens": 2}, timeout=60)
    assert ok.status_code == 200


def test_a_schema_compiles_off_the_engine_loop(server, monkeypatch):
    """The server compiles a request's grammar on a worker thread; the engine's loop, where
    every request's steps run, finds it compiled (xgrammar's cache)."""
    grammars, threads = server[1].grammars, []
    compile_spec = grammars.compile

    def compile_and_record(spec):
        threads.append(threading.current_thread().name)
        return compile_spec(spec)
    monkeypatch.setattr(grammars, "compile", compile_and_record)
    schema = {"type": "object", "properties": {"city_of_residence_in_2026": {"type": "string"}}}
    r = httpx.post(f"{server[0]}/v1/chat/completions", timeout=60, json={
        "model": MODEL, "messages": EXTRACT, "max_tokens": 30, "temperature": 0,
        "response_format": {"type": "json_schema", "json_schema": {"name": "where", "schema": schema}}})
    assert r.status_code == 200 and "city_of_residence_in_2026" in r.json()["choices"][0]["message"]["content"]
    assert threads[0] != "engine-loop" and set(threads[1:]) == {"engine-loop"}, threads  # then: cache hits


# ---- tools -----------------------------------------------------------------------------------------

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20}},
                   "required": ["city"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "description": "The time in a time zone",
    "parameters": {"type": "object", "properties": {"zone": {"type": "string", "maxLength": 10}},
                   "required": ["zone"], "additionalProperties": False}}}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


def streamed_calls(stream) -> tuple[str, list[dict], str]:
    """(content, tool calls, finish reason) accumulated from chat chunks, as SDK users do."""
    content, calls, reason = "", {}, None
    for chunk in stream:
        for choice in chunk.choices:
            content += choice.delta.content or ""
            for delta in choice.delta.tool_calls or []:
                call = calls.setdefault(delta.index, {"name": "", "arguments": ""})
                call["name"] += delta.function.name or ""
                call["arguments"] += delta.function.arguments or ""
            reason = choice.finish_reason or reason
    return content, [calls[i] for i in sorted(calls)], reason


@pytest.mark.parametrize("speculation", [None, {"method": "lookahead"}])
def test_a_named_function_is_called_with_valid_arguments(server, speculation):
    c = client(server[0])
    kwargs = dict(model=MODEL, messages=ASK, tools=[WEATHER, TIME], temperature=0, max_tokens=40,
                  tool_choice={"type": "function", "function": {"name": "get_weather"}},
                  extra_body={"speculation": speculation} if speculation else None)
    response = c.chat.completions.create(**kwargs)
    choice = response.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    call, = choice.message.tool_calls
    assert call.function.name == "get_weather" and call.id.startswith("call_")
    assert isinstance(json.loads(call.function.arguments)["city"], str)
    content, calls, reason = streamed_calls(c.chat.completions.create(**kwargs, stream=True))
    assert (content, reason) == ("", "tool_calls")
    assert calls == [{"name": "get_weather", "arguments": call.function.arguments}]


def test_required_calls_name_the_tools(server):
    c = client(server[0])
    for parallel in (True, False):
        response = c.chat.completions.create(model=MODEL, messages=ASK, tools=[WEATHER, TIME], tool_choice="required",
                                             parallel_tool_calls=parallel, temperature=0, max_tokens=80)
        choice = response.choices[0]
        assert choice.finish_reason == "tool_calls"
        assert choice.message.tool_calls and (parallel or len(choice.message.tool_calls) == 1)
        for call in choice.message.tool_calls:
            arguments = json.loads(call.function.arguments)
            assert (call.function.name, sorted(arguments)) in [("get_weather", ["city"]), ("get_time", ["zone"])]


HERMES = r'<tool_call>\{"name": "get_weather", "arguments": \{"city": "[A-Z][a-z]{1,12}"\}\}</tool_call>'


def test_auto_answers_in_text_or_with_hermes_calls(server):
    c = client(server[0])
    plain = c.chat.completions.create(model=MODEL, messages=ASK, tools=[WEATHER], temperature=0, max_tokens=16)
    assert plain.choices[0].message.tool_calls is None and plain.choices[0].message.content
    kwargs = dict(model=MODEL, messages=ASK, tools=[WEATHER], tool_choice="auto", temperature=0, max_tokens=64,
                  extra_body={"guided_regex": HERMES})
    called = c.chat.completions.create(**kwargs).choices[0]
    assert called.finish_reason == "tool_calls" and called.message.content is None
    assert called.message.tool_calls[0].function.name == "get_weather"
    city = json.loads(called.message.tool_calls[0].function.arguments)["city"]
    content, calls, reason = streamed_calls(c.chat.completions.create(**kwargs, stream=True))
    assert (content, reason) == ("", "tool_calls") and json.loads(calls[0]["arguments"]) == {"city": city}


def test_a_conversation_with_earlier_calls_and_their_results(server):
    c = client(server[0])
    messages = ASK + [
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function",
             "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "18 C and sunny"}]
    response = c.chat.completions.create(model=MODEL, messages=messages, tools=[WEATHER], temperature=0,
                                         max_tokens=12)
    assert response.choices[0].message.content


@pytest.mark.parametrize("body, param, message", [
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice",
     "not among the tools"),
    ({"tool_choice": "required"}, "tool_choice", "tool_choice needs tools"),
    ({"tools": [WEATHER], "tool_choice": "required", "response_format": {"type": "json_object"}}, "tool_choice",
     "constrains the output already"),
    ({"tools": [{"type": "function"}]}, "tools", "function"),
])
def test_bad_tool_requests_are_400s(server, body, param, message):
    r = httpx.post(f"{server[0]}/v1/chat/completions", json={"model": MODEL, "messages": ASK, "max_tokens": 5, **body},
                   timeout=60)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert message in error["message"] and error["param"] == param, error


# ---- LangChain ---------------------------------------------------------------------------------------

def langchain_chat(base_url: str):
    langchain_openai = pytest.importorskip("langchain_openai")
    return langchain_openai.ChatOpenAI(base_url=f"{base_url}/v1", api_key="x", model=MODEL, temperature=0,
                                       max_tokens=80, max_retries=0, timeout=120)


@pytest.mark.parametrize("method", ["json_schema", "function_calling", "json_mode"])
def test_langchain_structured_output(server, method):
    chat = langchain_chat(server[0])
    structured = chat.with_structured_output(Person if method != "json_mode" else Person.model_json_schema(),
                                             method=method)
    messages = EXTRACT if method != "json_mode" else [
        {"role": "user", "content": EXTRACT[0]["content"] + " Use the keys name, age and city."}]
    result = structured.invoke(messages)
    person = result if isinstance(result, Person) else Person.model_validate(result)
    assert person.age == 34 or method == "json_mode", person


def test_langchain_tool_calling_streamed_and_not(server):
    from langchain_core.tools import tool

    @tool
    def get_weather(city: str) -> str:
        """The weather in a city."""
        return "sunny"

    chat = langchain_chat(server[0]).bind_tools([get_weather], tool_choice="get_weather")
    message = chat.invoke(ASK)
    call, = message.tool_calls
    assert call["name"] == "get_weather" and isinstance(call["args"]["city"], str) and call["id"]
    streamed = None
    for chunk in chat.stream(ASK):
        streamed = chunk if streamed is None else streamed + chunk
    assert [(c["name"], c["args"]) for c in streamed.tool_calls] == [("get_weather", call["args"])]
