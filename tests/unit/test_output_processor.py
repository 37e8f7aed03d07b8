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
