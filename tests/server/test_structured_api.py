"""Structured output over HTTP, driven by the `openai` SDK (runtime.openai_protocol,
runtime.structured_output):

- the SDK's own structured-output helper, `client.chat.completions.parse` with a pydantic
  model, gets an instance back, with and without speculation, streamed and not;
- `response_format` json_object, and vLLM's guided_choice / guided_regex / guided_grammar /
  guided_json on both endpoints;
- a schema or grammar that does not compile, two kinds of constraint at once, and a bad
  guided_* value are 400s with OpenAI's error body, and the server goes on.
"""
from __future__ import annotations

import re

import httpx
import pytest
from pydantic import BaseModel

openai = pytest.importorskip("openai")
pytest.importorskip("uvicorn")

from runtime.async_engine import AsyncEngine  # noqa: E402
from runtime.serve import build_app  # noqa: E402
from tests.server.test_server import serving  # noqa: E402
from tests.server.test_server_api import MODEL, client, make_engine  # noqa: E402

EXTRACT = [{"role": "user", "content": "Extract the person: Maria Lopez, 34, is a nurse in Madrid. Reply in JSON."}]


class Person(BaseModel):
    name: str
    age: int
    city: str


@pytest.fixture(scope="module")
def server():
    engine = make_engine(max_num_seqs=8)
    async_engine = AsyncEngine(engine)
    try:
        with serving(build_app(async_engine, MODEL)) as base_url:
            yield base_url, engine
    finally:
        async_engine.shutdown()


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
     None, "JSON schema does not compile"),
    ({"guided_regex": "(abc"}, None, "regex does not compile"),
    ({"guided_grammar": 'root ::= "a" |'}, None, "grammar does not compile"),
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
    if param is not None:
        assert error["param"] == param
    ok = httpx.post(f"{base_url}/v1/completions", json={"model": MODEL, "prompt": "Hi", "max_tokens": 2}, timeout=60)
    assert ok.status_code == 200
