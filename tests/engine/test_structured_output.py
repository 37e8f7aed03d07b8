"""Structured output through the engine (runtime.structured_output), float32, default model,
with every speculator: none, ngram, lookahead, the draft model (the default model drafting
for itself, with draft probabilities), EAGLE (the shipped head) and Medusa (random heads).

- JSON schemas drawn by hypothesis (nested objects, arrays, enums, integers with bounds,
  optional and required fields): every output parses and validates (the `jsonschema`
  package), greedy and sampled, with every speculator. Greedy outputs are the same with
  every speculator as without (lossless); seeded sampled outputs too for the one-hot
  proposers (their coupled verification draws one token per emitted token).
- Choices, regexes and EBNF grammars hold, with speculation; drafts the grammar forbids
  are pruned (counted) before they reach verification; the text the grammar forces is
  drafted (counted), for every proposer, and the outputs stay those of plain decoding.
- A grammar that cannot finish within max_tokens ends with "length", the others in the
  batch go on.
"""
from __future__ import annotations

import json
import re

import jsonschema
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from runtime.models.loader import DEFAULT_MODEL
from runtime.sampling_params import GuidedSpec, SamplingParams
from tests.helpers import new_engine, save_random_medusa_heads

SPECULATORS = ["none", "ngram", "lookahead", "draft", "eagle", "medusa"]
ONE_HOT = ["none", "ngram", "lookahead", "eagle", "medusa"]
PERSON = [{"role": "user", "content": "Extract the person as JSON: Maria Lopez, 34, is a nurse in Madrid who "
                                      "likes tennis and chess. Her id is 7781."}]


@pytest.fixture(scope="module")
def engine(engine_f32, tmp_path_factory):
    heads_dir = save_random_medusa_heads(engine_f32.model, tmp_path_factory.mktemp("medusa"))
    engine = new_engine(draft_model=DEFAULT_MODEL, draft_device="cpu", draft_dtype="float32",
                        medusa_heads=str(heads_dir), adaptive_speculation=False)
    yield engine
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
    engine.close()


def run(engine, prompt, params: list[SamplingParams]) -> list:
    """Every request to its end; their last RequestOutputs, in order."""
    ids = [engine.add_request(prompt, p) for p in params]
    last = {}
    try:
        while engine.has_unfinished:
            for out in engine.step():
                if out.finished:
                    last[out.request_id] = out
    finally:
        for rid in ids:
            if rid not in last:
                engine.abort(rid)
    return [last[rid] for rid in ids]


NAMES = st.sampled_from(["name", "age", "city", "job", "hobbies", "id", "tags", "kind"])
LEAVES = st.one_of(
    st.just({"type": "string", "maxLength": 10}),
    st.just({"type": "integer", "minimum": 0, "maximum": 9999}),
    st.just({"type": "boolean"}),
    st.lists(st.sampled_from(["nurse", "doctor", "tennis", "chess", "Madrid", "other"]), min_size=1, max_size=4,
             unique=True).map(lambda values: {"enum": values}),
)


def objects(children):
    def with_required(props: dict):
        return st.sets(st.sampled_from(sorted(props))).map(lambda required: {
            "type": "object", "properties": props, "required": sorted(required), "additionalProperties": False})
    return st.dictionaries(NAMES, children, min_size=1, max_size=3).flatmap(with_required)


def arrays(children):
    return children.map(lambda items: {"type": "array", "items": items, "maxItems": 3})


SCHEMAS = objects(st.recursive(LEAVES, lambda children: st.one_of(objects(children), arrays(children)),
                               max_leaves=3))


@settings(max_examples=4, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(schema=SCHEMAS)
def test_outputs_validate_and_speculation_keeps_them(engine, schema):
    spec = GuidedSpec("json", schema)
    greedy = [SamplingParams(temperature=0, max_tokens=300, guided=spec, speculator=s) for s in SPECULATORS]
    sampled = [SamplingParams(temperature=1.0, seed=11, max_tokens=300, guided=spec, speculator=s)
               for s in SPECULATORS]
    outputs = run(engine, PERSON, greedy + sampled)
    for params, out in zip(greedy + sampled, outputs):
        label = f"{params.speculator}, temperature {params.temperature}: {out.text!r}"
        assert out.finish_reason == "stop", label
        jsonschema.validate(json.loads(out.text), schema)
    texts = {s: out.text for s, out in zip(SPECULATORS, outputs[:len(SPECULATORS)])}
    assert all(text == texts["none"] for text in texts.values()), texts
    sampled_texts = {s: out.text for s, out in zip(SPECULATORS, outputs[len(SPECULATORS):]) if s in ONE_HOT}
    assert all(text == sampled_texts["none"] for text in sampled_texts.values()), sampled_texts


NAME_AGE = r"[A-Z][a-z]+ [A-Z][a-z]+, \d{2}"


@pytest.mark.parametrize("spec, check, max_tokens", [
    (GuidedSpec("choice", ["positive", "negative", "neutral"]), lambda t: t in ("positive", "negative", "neutral"), 8),
    (GuidedSpec("regex", NAME_AGE), lambda t: re.fullmatch(NAME_AGE, t), 30),
    (GuidedSpec("grammar", 'root ::= "Name: " name "\\nAge: " [0-9]+\nname ::= [A-Za-z ]+'),
     lambda t: re.fullmatch(r"Name: [A-Za-z ]+\nAge: [0-9]+", t), 60),
], ids=["choice", "regex", "grammar"])
def test_choices_regexes_and_grammars_hold_with_speculation(engine, spec, check, max_tokens):
    params = [SamplingParams(temperature=t, seed=5, max_tokens=max_tokens, guided=spec, speculator=s)
              for s in ("none", "lookahead", "draft") for t in (0.0, 0.8)]
    for p, out in zip(params, run(engine, PERSON, params)):
        assert out.finish_reason == "stop" and check(out.text), (p.speculator, p.temperature, out.text)


def test_json_object_output_is_json_as_far_as_it_goes(engine):
    """Free JSON can run on (this model repeats keys), so max_tokens may cut it: every token
    must still be one xgrammar's own JSON grammar accepts, and a finished one parses."""
    import xgrammar as xgr
    params = [SamplingParams(temperature=t, seed=5, max_tokens=40, guided=GuidedSpec("json_object"), speculator=s)
              for s in ("none", "lookahead", "draft") for t in (0.0, 0.8)]
    for p, out in zip(params, run(engine, PERSON, params)):
        matcher = xgr.GrammarMatcher(engine.grammars.compiler.compile_builtin_json_grammar())
        assert out.text.startswith("{") and all(matcher.accept_token(t) for t in out.token_ids), out.text
        assert out.finish_reason == "length" or isinstance(json.loads(out.text), dict), out.text


def test_forbidden_drafts_are_pruned_before_verification(engine):
    """Lookahead drafts from the prompt's n-grams: most break the schema, and are counted."""
    schema = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
              "required": ["name", "age"], "additionalProperties": False}
    out, = run(engine, PERSON, [SamplingParams(temperature=0, max_tokens=60, guided=GuidedSpec("json", schema),
                                               speculator="lookahead", num_speculative_tokens=6)])
    assert json.loads(out.text)["age"] == 34
    assert out.metrics.num_pruned_draft_tokens > 0 and out.metrics.num_draft_tokens > 0, out.metrics


def test_forced_text_is_drafted_for_every_proposer(engine):
    """The schema's keys and punctuation are forced: drafted for every proposer, even where it
    drafts nothing; the target then runs fewer passes, the greedy output is plain decoding's."""
    schema = {"type": "object", "properties": {"full_name": {"type": "string"}, "years_of_age": {"type": "integer"},
                                               "place_of_residence": {"type": "string"}},
              "required": ["full_name", "years_of_age", "place_of_residence"], "additionalProperties": False}
    params = [SamplingParams(temperature=0, max_tokens=80, guided=GuidedSpec("json", schema), speculator=s)
              for s in SPECULATORS]
    outputs = run(engine, PERSON, params)
    plain = outputs[0]
    assert plain.metrics.num_forced_draft_tokens == 0 and json.loads(plain.text)["years_of_age"] == 34
    for p, out in zip(params[1:], outputs[1:]):
        assert out.text == plain.text, (p.speculator, out.text)
        assert out.metrics.num_forced_draft_tokens >= 10, (p.speculator, out.metrics)
        assert out.metrics.num_target_forwards < plain.metrics.num_target_forwards, (p.speculator, out.metrics)


def test_a_grammar_cut_short_by_max_tokens_ends_with_length(engine):
    spec = GuidedSpec("json", {"type": "object", "properties": {"name": {"type": "string"}}, "required": ["name"]})
    short, free = run(engine, PERSON, [SamplingParams(temperature=0, max_tokens=4, guided=spec, speculator="lookahead"),
                                       SamplingParams(temperature=0, max_tokens=12)])
    assert short.finish_reason == "length" and len(short.token_ids) == 4
    with pytest.raises(ValueError):
        json.loads(short.text)
    assert free.finish_reason in ("stop", "length") and free.text
