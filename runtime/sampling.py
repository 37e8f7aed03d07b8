"""Token sampling: greedy, temperature, top-k, top-p (Holtzman et al. 2019), per-request seeds.

`target_probs` turns logits into the distribution a request samples from (after its
temperature, top-k and top-p). runtime.rejection_sampler draws every emitted token from
it (plain decoding is verification of an empty draft tree), so acceptance is measured
against exactly that distribution.
"""
from __future__ import annotations

import torch

from runtime.sampling_params import SamplingParams


def apply_top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Mask to -inf what top-k / top-p exclude. logits [N, V]; top_k [N] (0 = off); top_p [N]."""
    sorted_logits, order = logits.sort(dim=-1, descending=True)  # [N, V]
    vocab = logits.shape[-1]
    ranks = torch.arange(vocab, device=logits.device).expand_as(sorted_logits)
    k = torch.where(top_k > 0, top_k, torch.full_like(top_k, vocab)).unsqueeze(1)
    remove = ranks >= k
    probs = sorted_logits.masked_fill(remove, float("-inf")).softmax(dim=-1)
    # drop a token when the tokens ranked above it already cover top_p; the first always stays
    mass_before = probs.cumsum(dim=-1) - probs
    remove |= mass_before >= top_p.unsqueeze(1)
    remove[:, 0] = False
    return logits.scatter(-1, order, sorted_logits.masked_fill(remove, float("-inf")))


def target_probs(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """logits [N, V] (float32) -> probabilities [N, V] after temperature, top-k and top-p.

    Greedy rows (temperature 0) become one-hot on the argmax.
    """
    device = logits.device
    greedy = torch.tensor([p.is_greedy for p in params], device=device)
    temps = torch.tensor([p.temperature if not p.is_greedy else 1.0 for p in params], device=device)
    scaled = logits / temps.unsqueeze(1)
    top_k = torch.tensor([p.top_k for p in params], device=device)
    top_p = torch.tensor([p.top_p for p in params], dtype=logits.dtype, device=device)
    if bool((top_k > 0).any()) or bool((top_p < 1).any()):
        scaled = apply_top_k_top_p(scaled, top_k, top_p)
    probs = scaled.softmax(dim=-1)
    if bool(greedy.any()):
        one_hot = torch.zeros_like(probs).scatter_(-1, logits.argmax(-1, keepdim=True), 1.0)
        probs = torch.where(greedy.unsqueeze(1), one_hot, probs)
    return probs
