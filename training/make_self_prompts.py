"""Write training prompts that the target model itself asks (self-instruct, the Magpie way).

The prompts of training/make_prompts.py are topics x a few request templates, so heads
trained on their answers learn those templates: the default model's Medusa heads reached a
validation tree acceptance of 2.18 on answers to such prompts but 1.76 on the held-out
prompts. An instruction-tuned model, given its chat template up to where the user's text
would start, writes a user's request of its own: sampling that many times gives prompts
as varied as what the model was tuned on (Xu et al. 2024, "Magpie"). No data leaves or
enters the machine; the prompts are the model's own.

Measured for the default model (README, "Self-asked prompts"): at the same number of
answers, Medusa heads trained on self-asked answers reached a lower held-out acceptance
than on template answers (1.65 against 1.70), so training does not read them by default.

Kept: requests that the model ends itself (its end-of-turn token), of a sensible length,
not seen twice, free of a few words of violence, hate and sex (`UNWANTED`), and that
neither use a held-out template nor name a held-out subject (make_prompts.mentions_heldout),
so held-out acceptance still measures prompts of a kind the heads never saw.

    python -m training.make_self_prompts --num-samples 3000 --out prompts-self.jsonl
    python -m scripts.train_medusa --data prompts-self.jsonl --corpus self-greedy.jsonl ...
"""
from __future__ import annotations

import argparse
import json
import re
import time

from training.make_prompts import heldout_subjects, mentions_heldout

SENTINEL = "\x00USER-TEXT\x00"
# a small model asks odd things now and then; these words keep violence, hate and sex out
UNWANTED = re.compile(r"\b(bombs?|weapons?|guns?|kill\w*|murder\w*|terror\w*|nazis?|racis\w*|homophob\w*|"
                      r"sex\w*|porn\w*|suicid\w*|drugs?)\b", re.IGNORECASE)


def pre_query_token_ids(tokenizer) -> list[int]:
    """The chat template rendered up to where the user's text starts (the default system
    prompt included, as the template writes it for a conversation without one)."""
    text = tokenizer.apply_chat_template([{"role": "user", "content": SENTINEL}], tokenize=False)
    prefix = text.split(SENTINEL)[0]
    if prefix == text:
        raise ValueError("the chat template does not show where the user's text goes")
    return tokenizer(prefix, add_special_tokens=False).input_ids


def keep(text: str, subjects: set[str], min_chars: int, max_chars: int) -> bool:
    return (min_chars <= len(text) <= max_chars and not mentions_heldout(text, subjects)
            and not UNWANTED.search(text))


def sample_requests(engine, num_samples: int, max_tokens: int, temperature: float, top_p: float,
                    seed: int) -> list[tuple[str, str]]:
    """(text, finish reason) of num_samples user turns the model writes, batched."""
    from tqdm import tqdm
    from runtime.sampling_params import SamplingParams
    prefix = pre_query_token_ids(engine.tokenizer)
    index = {}
    for i in range(num_samples):
        params = SamplingParams(temperature=temperature, top_p=top_p, max_tokens=max_tokens, seed=seed + i,
                                speculator="none")
        index[engine.add_request(prefix, params)] = i
    out: list[tuple[str, str] | None] = [None] * num_samples
    with tqdm(total=num_samples, desc="the model asks", unit="request") as bar:
        while engine.has_unfinished:
            for result in engine.step():
                if result.finished:
                    out[index[result.request_id]] = (result.text.strip(), result.finish_reason)
                    bar.update(1)
    return [r for r in out if r is not None]


def main(argv=None) -> int:
    from runtime.models.loader import DEFAULT_MODEL
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=DEFAULT_MODEL, help="the model that asks: alias, .gguf file or HF directory")
    p.add_argument("--out", required=True, help="prompt JSONL to write ({'messages': [...]} per line)")
    p.add_argument("--num-samples", type=int, default=3000, help="requests to sample (default: %(default)s); "
                                                                   "fewer are kept")
    p.add_argument("--max-tokens", type=int, default=96, help="a request cut at this length is dropped "
                                                              "(default: %(default)s)")
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--top-p", type=float, default=0.95)
    p.add_argument("--min-chars", type=int, default=16)
    p.add_argument("--max-chars", type=int, default=400)
    p.add_argument("--dtype", default="auto")
    p.add_argument("--device", default="auto")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--enforce-eager", action="store_true", help="the engine runs eagerly (no compiled decode step)")
    args = p.parse_args(argv)
    from runtime.engine import LLMEngine
    engine = LLMEngine(model=args.model, device=args.device, dtype=args.dtype, max_num_seqs=64, seed=args.seed,
                       enforce_eager=args.enforce_eager)
    start = time.perf_counter()
    requests = sample_requests(engine, args.num_samples, args.max_tokens, args.temperature, args.top_p, args.seed)
    engine.close()
    subjects = heldout_subjects()
    kept, seen = [], set()
    for text, reason in requests:
        if reason == "stop" and text.lower() not in seen and keep(text, subjects, args.min_chars, args.max_chars):
            seen.add(text.lower())
            kept.append(text)
    with open(args.out, "w") as f:
        for text in kept:
            f.write(json.dumps({"messages": [{"role": "user", "content": text}]}) + "\n")
    print(f"{len(kept)} of {len(requests)} sampled requests kept in {time.perf_counter() - start:.0f} s "
          f"-> {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
