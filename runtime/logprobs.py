"""Log probabilities of emitted tokens, as OpenAI's `logprobs` / `top_logprobs` report them.

They are the target model's own distribution (log_softmax of its logits, before
temperature, top-k and top-p), as vLLM reports by default: the same whatever the sampling
settings, and exactly what a plain forward of the final text gives at each position. A
verify step emits several tokens; token j's row is the logits of its parent (the root for
the first token, then each accepted node in turn).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(slots=True)
class TokenLogprobs:
    token_id: int
    logprob: float
    top: list[tuple[int, float]]  # the `num_top` most likely tokens and their logprobs, most likely first


def token_logprobs(logits: torch.Tensor, token_ids: list[int], num_top: int) -> list[TokenLogprobs]:
    """logits [n, V]: row j the distribution token_ids[j] was drawn from."""
    logprobs = torch.log_softmax(logits.float(), dim=-1)  # [n, V]
    chosen = logprobs.gather(1, torch.tensor(token_ids, device=logits.device).unsqueeze(1)).squeeze(1).tolist()
    if num_top:
        top_values, top_ids = logprobs.topk(num_top, dim=-1)  # [n, num_top]
        tops = [list(zip(ids, values)) for ids, values in zip(top_ids.tolist(), top_values.tolist())]
    else:
        tops = [[] for _ in token_ids]
    return [TokenLogprobs(t, lp, top) for t, lp, top in zip(token_ids, chosen, tops)]


def layout_logprobs(layout, verdicts: list, logits: torch.Tensor) -> dict[str, list[TokenLogprobs]]:
    """Per request of a step (runtime.verify_layout.VerifyLayout) that asked for them, the
    logprobs of the tokens its verdict emits; logits [R, V] as the layout says."""
    out: dict[str, list[TokenLogprobs]] = {}
    for k, (seq, verdict) in enumerate(zip(layout.sampled_seqs, verdicts)):
        if seq.params.logprobs is not None:
            rows = layout.kept_logit_rows(k, verdict.accepted_nodes)
            out[seq.request_id] = token_logprobs(logits[rows], verdict.token_ids, seq.params.logprobs)
    return out
