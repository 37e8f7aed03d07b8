"""Structured output with and without speculation, on input-grounded JSON extraction prompts.

Each prompt asks the model to extract fields from a short text into JSON; its schema names
the fields. Rows: {free text, JSON schema constraint} x {speculators}, one engine with the
default settings (the rows switch per request, SamplingParams.speculator), single stream,
greedy, each request stopping at EOS or --max-tokens. Reported per row: decode tok/s (output
tokens after the first over the time after the first: the prompts are the same in every
row, the outputs' lengths are not; the median of --repeats interleaved rounds), tokens per
verify step, the outputs that parse and validate against their schema and those max_tokens
cut, the draft tokens the grammar forced per output token, whether the outputs are those of
the same constraint without speculation, and the grammar's own cost per output token
(masks, pruning, forced drafts and advancing the matcher, timed around
runtime.structured_output's calls).

Targets (issue 38): constrained decoding with speculation >= 0.95x free decoding with the
same speculator, and >= 1.5x constrained decoding without speculation.

    python -m scripts.bench_structured
    python -m scripts.bench_structured --speculators none,lookahead --repeats 1 --max-tokens 16   # smoke test
"""
from __future__ import annotations

import argparse
import json
import time
from typing import NamedTuple

import jsonschema

from runtime import LLM, GuidedSpec
from runtime.structured_output import Constraint, StepMasks
from scripts.harness import Measure, Report, add_results_args, greedy, interleaved, log, median, ratio

PERSON = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"},
                                           "job": {"type": "string"}, "city": {"type": "string"}},
          "required": ["name", "age", "job", "city"], "additionalProperties": False}
PRODUCT = {"type": "object", "properties": {"product": {"type": "string"}, "price": {"type": "number"},
                                            "currency": {"type": "string", "enum": ["USD", "EUR", "GBP"]},
                                            "in_stock": {"type": "boolean"}},
           "required": ["product", "price", "currency", "in_stock"], "additionalProperties": False}
EVENT = {"type": "object", "properties": {"event": {"type": "string"}, "date": {"type": "string"},
                                          "place": {"type": "string"},
                                          "speakers": {"type": "array", "items": {"type": "string"}, "maxItems": 4}},
         "required": ["event", "date", "place", "speakers"], "additionalProperties": False}
TASKS = [
    ("Maria Lopez is 34 years old and works as a nurse in Madrid.", PERSON),
    ("Our engineer, Tom Becker (52), lives in Hamburg and builds bridges.", PERSON),
    ("Ken Sato, a 27-year-old chef from Osaka, opened his first restaurant.", PERSON),
    ("The UltraBlend 3000 blender costs 89.99 EUR and is currently in stock.", PRODUCT),
    ("Sold out: the Trailmaster backpack, priced at 120 USD.", PRODUCT),
    ("The Nordic AI Summit takes place on 12 March 2027 in Oslo, with talks by Anna Berg and Lars Holm.", EVENT),
    ("PyData Lisbon, 4 June 2027, at the Lisbon Congress Centre; speakers: Rui Costa, Ines Sousa, Joao Reis.",
     EVENT),
    ("The wool scarf by Highland Knits sells for 35 GBP and is in stock.", PRODUCT),
]


class Row(NamedTuple):
    constrained: bool
    speculator: str

    @property
    def key(self) -> tuple:
        return self

    @property
    def label(self) -> str:
        return f"{'schema' if self.constrained else 'free'} / {self.speculator}"


class GrammarClock:
    """Seconds the engine's thread spends in the grammar's calls: masks, pruning, forced
    drafts and advancing (the masks filled on the grammar thread while the target runs
    count only where the sampler waits for them)."""

    def __init__(self):
        self.seconds = 0.0
        timed = self._timed
        StepMasks.__init__ = timed(StepMasks.__init__)  # forks the matchers (and fills, without overlap)
        StepMasks.apply = timed(StepMasks.apply)  # waits for the grammar thread, writes the masks
        Constraint.prune = timed(Constraint.prune)
        Constraint.extend = timed(Constraint.extend)
        Constraint.accept = timed(Constraint.accept)

    def _timed(self, fn):
        def wrapper(*args, **kwargs):
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.seconds += time.perf_counter() - start
        return wrapper


def prompt(text: str, schema: dict) -> list[dict]:
    fields = ", ".join(schema["properties"])
    return [{"role": "user", "content": f"Extract {fields} from this text as a JSON object.\nText: {text}"}]


def valid(text: str, schema: dict) -> bool:
    try:
        jsonschema.validate(json.loads(text), schema)
        return True
    except (ValueError, jsonschema.ValidationError):
        return False


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--speculators", default="none,lookahead,ngram,eagle", help="default: %(default)s")
    p.add_argument("--max-tokens", type=int, default=96, help="per request (default: %(default)s)")
    p.add_argument("--repeats", type=int, default=3, help="interleaved rounds (default: %(default)s)")
    add_results_args(p, "bench_structured")
    args = p.parse_args(argv)
    report = Report(args.name, "Structured output with speculation", "scripts.bench_structured", argv, args)
    llm = LLM(model=args.model)
    clock = GrammarClock()
    rows = [Row(c, s) for s in args.speculators.split(",") for c in (False, True)]
    validity: dict[Row, list[bool]] = {}
    cut: dict[Row, list[bool]] = {}  # whether max_tokens cut each prompt's output
    grammar_s: dict[Row, list[float]] = {}
    forced: dict[Row, float] = {}  # forced draft tokens per output token, the last round

    def run(row: Row, measure) -> None:
        tokens, seconds, outputs, checks, cuts, spent, num_forced = 0, 0.0, [], [], [], 0.0, 0
        for text, schema in TASKS:
            params = greedy(args.max_tokens, speculator=row.speculator,
                            guided=GuidedSpec("json", schema) if row.constrained else None)
            before = clock.seconds
            start = time.perf_counter()
            result = llm.generate([prompt(text, schema)], params, use_tqdm=False)[0]
            wall = time.perf_counter() - start
            spent += clock.seconds - before
            metrics = result.metrics
            # decoding alone (after the first token): prompts are the same in every row, outputs are not
            seconds += metrics.e2e_s - metrics.ttft_s if metrics.ttft_s is not None else wall
            tokens += len(result.token_ids) - 1
            outputs.append(result.token_ids)
            checks.append(valid(result.text, schema))
            cuts.append(result.finish_reason == "length")
            num_forced += metrics.num_forced_draft_tokens
            measure.add_metrics([result])
        measure.add_round(tokens, seconds, outputs)
        validity[row], cut[row], forced[row] = checks, cuts, num_forced / max(len(outputs) + tokens, 1)
        grammar_s.setdefault(row, []).append(spent / max(tokens, 1))

    def warm(row: Row) -> None:
        run(row, Measure())
        grammar_s.pop(row)

    measures = interleaved(rows, args.repeats, run, warm=warm, label=lambda r: r.label)
    table = []
    for row in rows:
        m = measures[row]
        free = measures[Row(False, row.speculator)]
        plain = measures.get(Row(True, "none"))
        table.append([row.label, f"{m.rate:.1f}", f"{m.acceptance_length:.2f}" if m.acceptance_length else "-",
                      f"{sum(validity[row])}/{len(TASKS)}", sum(cut[row]),
                      f"{forced[row]:.2f}" if row.constrained else "-",
                      m.same_outputs(plain) if row.constrained and row.speculator != "none" else "-",
                      f"{median(grammar_s[row]) * 1e6:.0f}" if row.constrained else "-",
                      ratio(m.rate, free.rate) if row.constrained else "-",
                      ratio(m.rate, plain.rate) if row.constrained and plain is not None else "-"])
        report.data[row.label] = {**m.summary(), "valid": sum(validity[row]), "prompts": len(TASKS),
                                  "cut": sum(cut[row]), "forced_per_token": forced[row] if row.constrained else None,
                                  "same_as_schema_none": m.same_outputs(plain) if row.constrained else None,
                                  "grammar_us_per_token": median(grammar_s[row]) * 1e6 if row.constrained else None}
    report.line(f"{args.model}, default settings, single stream, greedy, {len(TASKS)} extraction prompts, "
                f"max {args.max_tokens} tokens, median of {args.repeats} rounds")
    report.line()
    report.table(["row", "decode tok/s", "tokens/step", "valid JSON", "cut by max_tokens", "forced drafts/token",
                  "same as schema / none", "grammar µs/token",
                  "vs free, same speculator", "vs schema / none"], table)
    report.write()


if __name__ == "__main__":
    log("bench_structured: loading")
    main()
