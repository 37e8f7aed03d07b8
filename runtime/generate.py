"""Offline batch generation from a JSONL file: `python -m runtime.generate`.

    python -m runtime.generate --model smollm2-135m --input prompts.jsonl --output out.jsonl \\
        --max-tokens 128 --temperature 0

Each input line is a JSON object with either
    "prompt":   a string (or a list of token ids), or
    "messages": a list of chat messages ({"role": ..., "content": ...}), rendered with the
                model's chat template,
and optionally "tools" beside "messages" (rendered by the chat template), any of
SamplingParams' fields ("max_tokens", "temperature", "top_p", "top_k", "seed", "stop",
"stop_token_ids", "ignore_eos", "include_stop_str_in_output", "logprobs", "speculator",
"num_speculative_tokens", "n"), which override the command-line flags for that line, and one of
"guided_json" (a JSON schema), "guided_regex", "guided_choice" (a list of strings) and
"guided_grammar" (EBNF), which hold the output to it (runtime.structured_output). The
server's other request fields ("response_format", "presence_penalty", "model", ...)
make the line skipped, never silently ignored. Every other key (an "id", say) is
copied to the output line, which adds
    "text", "token_ids", "finish_reason" ("stop" | "length"),
    "metrics": {"ttft_s", "tpot_s", "e2e_s", "num_tokens", ...} (runtime.sequence.RequestMetrics),
    and, when the line asks for "logprobs": k, "logprobs": per output token
    {"token_id", "logprob", "top": [[token id, logprob], ...k most likely]};
a line that sets "n" (completions sampled for its prompt; completion i of a seeded line
is seeded seed + i) gets instead "outputs": a list of n objects with those keys.

Outputs are written in input order. The file is generated in batches of --batch-size
prompts, and each batch's results are flushed before the next batch is read, so a run
that fails or is interrupted keeps everything it finished.

A line that cannot be generated (invalid JSON or UTF-8, not an object, neither or both of
"prompt" and "messages", an invalid sampling value, a key the output uses ("text",
"token_ids", "finish_reason", "metrics", "outputs"), an empty prompt or one too long for the
model's context) is skipped: it gets no output line, it is reported on stderr as
`INPUT:LINE: skipped: REASON`, and the run goes on with the rest. Blank lines are ignored.

Exit status: 0 when every line was generated; 1 when some lines were skipped; 2 when
nothing could run (missing input file or model, an output that cannot be written, bad
engine settings) or writing failed part way (the lines written so far are kept); 130 when
interrupted (Ctrl-C) after writing the batches already finished.
"""
from __future__ import annotations

import argparse
import dataclasses
import difflib
import json
import os
import re
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Iterator

from runtime.config import ENGINE_ARGS, add_engine_args
from runtime.openai_protocol import ChatCompletionRequest, CompletionRequest
from runtime.prompts import is_token_ids
from runtime.sampling_params import GuidedSpec, SamplingParams

if TYPE_CHECKING:
    from runtime.llm import LLM

# Keys an input line may use to set its own sampling; they override the flags.
SAMPLING_KEYS = ("max_tokens", "temperature", "top_p", "top_k", "seed", "stop", "stop_token_ids", "ignore_eos",
                 "include_stop_str_in_output", "logprobs", "speculator", "num_speculative_tokens", "n")
GUIDED_KEYS = ("guided_json", "guided_regex", "guided_choice", "guided_grammar")  # one, at most
PROMPT_KEYS = ("prompt", "messages")
OUTPUT_KEYS = ("text", "token_ids", "finish_reason", "metrics", "outputs")
# the server's request fields (runtime.openai_protocol) that a line does not take: a line with one is
# skipped rather than run without it ("user", which changes no output, is carried like any other key)
UNSUPPORTED_KEYS = tuple(sorted({*CompletionRequest.model_fields, *ChatCompletionRequest.model_fields}
                                - {*SAMPLING_KEYS, *GUIDED_KEYS, *PROMPT_KEYS, "tools", "user"}))

TAKEN_KEYS = (*SAMPLING_KEYS, *GUIDED_KEYS, *PROMPT_KEYS, *OUTPUT_KEYS, *UNSUPPORTED_KEYS, "tools", "user")

EXIT_OK, EXIT_SKIPPED, EXIT_ERROR, EXIT_INTERRUPTED = 0, 1, 2, 130

EPILOG = """\
input lines:  {"prompt": "..."} or {"messages": [{"role": "user", "content": "..."}]},
              optionally with tools (beside messages), SamplingParams' fields
              (max_tokens, temperature, top_p, top_k, seed, stop, stop_token_ids,
              ignore_eos, include_stop_str_in_output, logprobs, speculator,
              num_speculative_tokens, n: they override the flags), and one of guided_json,
              guided_regex, guided_choice, guided_grammar; other keys (e.g. "id") are
              copied to the output, but for the server's other request fields
              (response_format, ...), which skip the line, and for near misses of the
              keys above ("max_token"), which skip it as typos.
output lines: the copied keys plus text, token_ids, finish_reason and metrics
              (ttft_s, tpot_s, e2e_s, num_tokens, ...), and logprobs when asked for,
              in input order; a line that sets n gets "outputs", a list of n such
              completions, instead.
bad lines:    invalid JSON, neither "prompt" nor "messages", invalid sampling values,
              output keys in the input, prompts too long for the context: each is
              reported on stderr as INPUT:LINE: skipped: REASON, gets no output line,
              and the rest still run.
exit status:  0 all lines generated; 1 some lines skipped; 2 nothing ran (missing
              input or model, bad engine settings); 130 interrupted.
"""


class LineError(ValueError):
    """Why one input line is skipped."""


@dataclass(slots=True)
class Job:
    prompt_token_ids: list[int]
    params: SamplingParams
    carried: dict  # input keys copied to the output line
    lists_outputs: bool = False  # the line set "n": its completions go in a list, "outputs"


def build_parser() -> argparse.ArgumentParser:
    defaults = SamplingParams()
    p = argparse.ArgumentParser(
        prog="python -m runtime.generate", description="Generate completions for every line of a JSONL file.",
        epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m", help="alias, .gguf file or HF directory (default: %(default)s)")
    p.add_argument("--input", required=True, help="JSONL file of prompts")
    p.add_argument("--output", required=True, help="JSONL file to write (overwritten)")
    p.add_argument("--max-tokens", type=int, default=defaults.max_tokens, help="default: %(default)s")
    p.add_argument("--temperature", type=float, default=defaults.temperature, help="0 is greedy (default: %(default)s)")
    p.add_argument("--top-p", type=float, default=defaults.top_p, help="default: %(default)s (off)")
    p.add_argument("--top-k", type=int, default=defaults.top_k, help="default: %(default)s (off)")
    p.add_argument("--seed", type=int, default=None,
                   help="seed of the engine's sampler: the same file and flags give the same output. "
                        "A line's own \"seed\" gives that request its own generator")
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    p.add_argument("--device", default="auto", help="auto | cpu | cuda | cuda:N (default: %(default)s)")
    p.add_argument("--max-num-seqs", type=int, default=64, help="sequences decoded together (default: %(default)s)")
    p.add_argument("--max-num-batched-tokens", type=int, default=2048,
                   help="token budget of one engine step (default: %(default)s)")
    p.add_argument("--kv-cache-memory", default=None,
                   help="KV cache size: bytes, 2GiB, 500MB, or a fraction of free memory like 0.2")
    p.add_argument("--no-prefix-caching", dest="enable_prefix_caching", action="store_false",
                   help="compute every prompt in full instead of reusing the KV of prefixes shared with "
                        "earlier prompts")
    p.add_argument("--batch-size", type=int, default=256,
                   help="prompts generated together; each batch is written before the next is read "
                        "(default: %(default)s)")
    add_engine_args(p)
    return p


def main(argv: list[str] | None = None, *, llm: LLM | None = None) -> int:
    """Run the CLI; return the exit status. `llm`: an already-built engine to use instead
    of loading one (tests, notebooks); the model and engine flags are then ignored."""
    args = build_parser().parse_args(argv)
    if args.batch_size < 1:
        return _fail(f"--batch-size must be >= 1, got {args.batch_size}")
    if not re.fullmatch(r"auto|cpu|cuda(:\d+)?", args.device):
        return _fail(f"--device must be auto, cpu, cuda or cuda:N, got {args.device!r}")
    input_path, output_path = Path(args.input), Path(args.output)
    if not input_path.is_file():
        return _fail(f"input file {str(input_path)!r} " + ("is not a file" if input_path.exists() else "not found"))
    if output_path.exists() and output_path.resolve() == input_path.resolve():
        return _fail("--output is the input file; it would be overwritten")
    unwritable = _cannot_write(output_path)
    if unwritable:  # before the model loads
        return _fail(f"cannot write {str(output_path)!r}: {unwritable}")
    try:
        defaults = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                                  top_k=args.top_k)
    except ValueError as e:
        return _fail(str(e))
    if llm is None:
        try:
            llm = _load(args)
        except (OSError, ValueError) as e:  # ModelNotFoundError is an OSError; bad settings a ValueError
            return _fail(str(e))
    try:
        out = output_path.open("w", encoding="utf-8")
    except OSError as e:
        return _fail(f"cannot write {str(output_path)!r}: {e.strerror or e}")

    num_skipped = 0
    elapsed = 0.0
    finished: list = []  # GenerationResults written so far, for the summary
    try:
        try:
            for jobs, skipped in _batches(input_path, llm, defaults, args.batch_size):
                num_skipped += skipped
                if not jobs:
                    continue
                results = llm.generate([j.prompt_token_ids for j in jobs], [j.params for j in jobs])
                _write(out, [json.dumps(output_record(job, r), ensure_ascii=False) + "\n"
                             for job, r in zip(jobs, results)])
                finished += results
                elapsed += llm.last_summary.elapsed_s
        finally:
            _write(out, None)  # closes it
    except KeyboardInterrupt:
        print(f"interrupted: {len(finished)} results were written to {output_path}", file=sys.stderr)
        return EXIT_INTERRUPTED
    except OutputError as e:  # the output's disk is full, or went away
        return _fail(f"writing {str(output_path)!r} failed ({e}); the {len(finished)} results of the batches "
                     f"before were written")
    except Exception:
        print(f"failed: {len(finished)} results were written to {output_path}", file=sys.stderr)
        raise

    from runtime.llm import RunSummary
    print(f"summary: {RunSummary.of(finished, elapsed)}", file=sys.stderr)
    if num_skipped:
        print(f"skipped {num_skipped} input line(s); see the messages above", file=sys.stderr)
        return EXIT_SKIPPED
    return EXIT_OK


def _load(args) -> LLM:
    from runtime.llm import LLM
    from runtime.models.loader import resolve_model
    resolve_model(args.model)  # a missing model fails here, before torch loads anything big
    speculation = {name: getattr(args, name) for name in ENGINE_ARGS if getattr(args, name) is not None}
    return LLM(model=args.model, dtype=args.dtype, device=args.device, max_num_seqs=args.max_num_seqs,
               max_num_batched_tokens=args.max_num_batched_tokens, kv_cache_memory=args.kv_cache_memory,
               enable_prefix_caching=args.enable_prefix_caching, seed=args.seed, **speculation)


def output_record(job: Job, result) -> dict:
    """An output line: the input's carried keys, then the result (runtime.llm.GenerationResult):
    its completion's fields, or, when the line set "n", "outputs": a list of them."""
    if job.lists_outputs:
        return {**job.carried, "outputs": [completion_record(c) for c in result.outputs]}
    return {**job.carried, **completion_record(result.outputs[0])}


def completion_record(completion) -> dict:
    """text, token_ids, finish_reason, metrics and (when asked for) logprobs of a runtime.llm.Completion."""
    record = {"text": completion.text, "token_ids": completion.token_ids, "finish_reason": completion.finish_reason,
              "metrics": completion.metrics.as_dict()}
    if completion.logprobs is not None:
        record["logprobs"] = [{"token_id": t.token_id, "logprob": t.logprob, "top": [list(pair) for pair in t.top]}
                              for t in completion.logprobs]
    return record


class OutputError(Exception):
    """Writing the output file failed (its OSError's reason)."""


def _write(out, lines: list[str] | None) -> None:
    """Write lines to the output and flush them (None: close it); OutputError on failure."""
    try:
        if lines is None:
            out.close()
        else:
            out.writelines(lines)
            out.flush()
    except OSError as e:
        raise OutputError(e.strerror or str(e)) from None


def _cannot_write(path: Path) -> str | None:
    """Why the output file cannot be written (None: it can)."""
    if path.is_dir():
        return "it is a directory"
    parent = path.parent
    if not parent.is_dir():
        return f"{str(parent)!r} is not a directory"
    if not os.access(path if path.exists() else parent, os.W_OK):
        return "permission denied"
    return None


def _fail(message: str) -> int:
    print(f"error: {message}", file=sys.stderr)
    return EXIT_ERROR


def _batches(path: Path, llm: LLM, defaults: SamplingParams, size: int) -> Iterator[tuple[list[Job], int]]:
    """Yield (up to `size` valid jobs, number of lines skipped among them), reading lazily;
    each skipped line is reported on stderr as it is found."""
    jobs, skipped = [], 0
    with path.open("rb") as f:
        for line_no, raw in enumerate(f, 1):
            if not raw.strip():
                continue
            try:
                jobs.append(parse_line(raw, llm, defaults))
            except LineError as e:
                print(f"{path}:{line_no}: skipped: {e}", file=sys.stderr)
                skipped += 1
                continue
            if len(jobs) == size:
                yield jobs, skipped
                jobs, skipped = [], 0
    yield jobs, skipped


def parse_line(raw: bytes, llm: LLM, defaults: SamplingParams) -> Job:
    """One input line -> a validated, tokenized Job; LineError says why it cannot run."""
    try:
        record = json.loads(raw.decode("utf-8").rstrip("\r\n"))  # the error's column on the line, not past it
    except UnicodeDecodeError as e:
        raise LineError(f"not UTF-8 ({e.reason} at byte {e.start})") from None
    except json.JSONDecodeError as e:
        raise LineError(f"invalid JSON ({e.msg} at column {e.colno})") from None
    if not isinstance(record, dict):
        raise LineError(f"expected a JSON object, got {type(record).__name__}")
    _check_spelling(record)
    present = [k for k in PROMPT_KEYS if k in record]
    if len(present) != 1:
        raise LineError('needs exactly one of "prompt" and "messages"')
    prompt = record["prompt"] if "prompt" in record else record["messages"]
    if "prompt" in record and not (isinstance(prompt, str) or is_token_ids(prompt)):
        raise LineError('"prompt" must be a string or a list of token ids')
    if "messages" in record and not (isinstance(prompt, list) and prompt and all(isinstance(m, dict) for m in prompt)):
        raise LineError('"messages" must be a non-empty list of {"role": ..., "content": ...} objects')
    reserved = [k for k in OUTPUT_KEYS if k in record]
    if reserved:
        raise LineError(f"key {reserved[0]!r} is reserved for the output")
    unsupported = [k for k in UNSUPPORTED_KEYS if k in record]
    if unsupported:
        raise LineError(f"key {unsupported[0]!r} is a server request field that runtime.generate does not take")
    if "tools" in record:
        if "messages" not in record:
            raise LineError('"tools" go with "messages"')
        prompt = {"messages": prompt, "tools": record["tools"]}

    overrides = {k: record[k] for k in SAMPLING_KEYS if k in record}
    guided = [k for k in GUIDED_KEYS if k in record]
    if len(guided) > 1:
        raise LineError(f"asks for {' and '.join(guided)}; one constraint a line")
    try:
        if guided:
            overrides["guided"] = GuidedSpec(guided[0].removeprefix("guided_"), record[guided[0]])
        params = dataclasses.replace(defaults, **overrides)
        llm.engine.check_params(params)
        token_ids = llm.engine.prompt_token_ids(prompt)
    except (TypeError, ValueError) as e:
        raise LineError(str(e)) from None
    carried = {k: v for k, v in record.items() if k not in (*PROMPT_KEYS, *SAMPLING_KEYS, *GUIDED_KEYS, "tools")}
    return Job(token_ids, params, carried, lists_outputs="n" in record)


def _check_spelling(record: dict) -> None:
    """A key that is not one a line takes but nearly is (\"max_token\", \"stops\") is a typo,
    which copying it to the output would hide: the line runs without the setting."""
    for key in record:
        if key in TAKEN_KEYS:
            continue
        close = difflib.get_close_matches(key.lower().replace("-", "_"), TAKEN_KEYS, n=1, cutoff=0.85)
        if close:
            raise LineError(f"unknown key {key!r}; did you mean {close[0]!r}? (other keys are copied to the output)")


if __name__ == "__main__":
    sys.exit(main())
