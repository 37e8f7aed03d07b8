"""Stop strings against str.find on the decoded text: the output ends where the first stop
string begins (or after it, with include_stop_str_in_output), whichever tokens it spans and
however many tokens a step appends; the deltas reported add up to the text, and nothing
reported is taken back."""
from __future__ import annotations

import pytest

from runtime.models.loader import load_tokenizer, resolve_model
from runtime.output_processor import OutputProcessor, RequestState
from runtime.sampling_params import SamplingParams
from runtime.sequence import Sequence

TEXT = " Paris.\n\nThe answer is Paris. The capital of France is Paris."


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(resolve_model("smollm2-135m"))


def expected(text: str, stops: list[str], include: bool) -> str:
    hits = [(text.find(s), s) for s in stops if s in text]
    if not hits:
        return text
    at, stop = min(hits)
    return text[:at + len(stop)] if include else text[:at]


def run(tokenizer, token_ids: list[int], params: SamplingParams, per_step: int):
    """(final text, deltas, the text reported after each step, finish reason)."""
    processor = OutputProcessor(tokenizer, max_model_len=10_000)
    state = RequestState(Sequence("r", [1, 2], params))
    deltas, texts = [], []
    for start in range(0, len(token_ids), per_step):
        out = processor.append(state, token_ids[start:start + per_step], None)
        deltas.append(out.delta_text)
        texts.append(out.text)
        if out.finished:
            return out.text, deltas, texts, out.finish_reason
    raise AssertionError("never finished")


@pytest.mark.parametrize("stops", [["\n\nThe"], [" Paris."], ["The answer"], ["is Paris. The", "answer"],
                                   ["Paris"], ["capital of France"], ["not there"], ["\n\nThe", "The ans"]])
@pytest.mark.parametrize("include", [False, True])
@pytest.mark.parametrize("per_step", [1, 3, 100])
def test_stop_strings_end_the_text_where_they_begin(tokenizer, stops, include, per_step):
    token_ids = tokenizer(TEXT, add_special_tokens=False).input_ids
    assert tokenizer.decode(token_ids) == TEXT
    params = SamplingParams(max_tokens=len(token_ids), stop=stops, include_stop_str_in_output=include)
    text, deltas, texts, reason = run(tokenizer, token_ids, params, per_step)
    assert text == expected(TEXT, stops, include)
    assert reason == ("length" if text == TEXT else "stop")
    assert "".join(deltas) == text
    for earlier, later in zip(texts, texts[1:]):
        assert later.startswith(earlier)  # nothing reported is taken back


def test_a_grammar_no_token_can_continue_ends_the_output_short(tokenizer):
    """A regex whose second character no token of SmolLM2's vocabulary (as xgrammar reads
    it) begins: after "a" the masks allow nothing, the sampler picks some token anyway, and
    the request ends with finish_reason "length" and without that token, not with an error
    (schemathesis found it as a 500). A grammar dead from its first token is refused when it
    compiles (tests/server/test_structured_api.py)."""
    from runtime.sampling_params import GuidedSpec
    from runtime.structured_output import Grammars, allowed_tokens
    import xgrammar as xgr

    spec = GuidedSpec("regex", "a\U00040000")
    constraint = Grammars(tokenizer, len(tokenizer), [tokenizer.eos_token_id]).constraint(spec)
    a, = tokenizer.encode("a", add_special_tokens=False)
    fork = constraint.fork()
    assert fork.accept(a)
    bitmask = xgr.allocate_token_bitmask(1, len(tokenizer))
    fork.matcher.fill_next_token_bitmask(bitmask, 0)
    assert not allowed_tokens(bitmask, [0], len(tokenizer)).any()  # a dead end after "a"
    seq = Sequence("r", [1, 2], SamplingParams(max_tokens=8, guided=spec))
    seq.constraint = constraint
    out = OutputProcessor(tokenizer, max_model_len=10_000).append(RequestState(seq), [a, 0], None)
    assert out.finished and out.finish_reason == "length"
    assert out.token_ids == [a] and out.text == "a"
