"""The one interface every proposer implements.

Each step the engine hands a proposer the decoding sequences it serves, with a node
budget per sequence (chosen by the engine from measured acceptance and costs), and gets
back one DraftTree per sequence (empty = nothing to propose). After verification the
proposer hears what was kept through `on_accepted` (to roll back draft KV or update its
caches), and `release` when a sequence leaves for good.
"""
from __future__ import annotations

import copy
from abc import ABC, abstractmethod
from dataclasses import dataclass, field

import torch

from runtime.models.packed_linear import PackedLinear, can_prepack
from runtime.models.quant_linear import QuantizedLinear, float_linear
from runtime.sampling_params import SamplingParams
from runtime.draft_tree import DraftTree

IGNORE = -100  # a label the training cross-entropy skips; a target token outside a draft vocabulary


@dataclass(slots=True)
class ProposalRequest:
    request_id: str
    token_ids: list[int]  # prompt + output so far (the engine's list: read it, never change it)
    num_prompt_tokens: int
    max_nodes: int  # node budget for this step (>= 1)
    tree_width: int  # most children per node; 1 = chains only
    params: SamplingParams
    generator: torch.Generator | None = None  # the request's own, for sampled drafting
    last_logits: torch.Tensor | None = None  # [V] the target's logits for the last token, when asked
    last_hidden: torch.Tensor | None = None  # [H] the target's hidden state there, when asked
    # proposers with needs_features: the target's hidden states of the tokens committed since
    # the last proposal, as (first position, [n, H']) pieces in order (H' as ModelRunner.execute)
    new_features: list[tuple[int, torch.Tensor]] = field(default_factory=list)


@dataclass(slots=True)
class TargetInfo:
    """What a proposer may know about the target model (to match vocabularies, size caches)."""

    vocab_size: int
    tokenizer: object  # the target's transformers tokenizer
    device: torch.device
    dtype: str  # the target's resolved dtype name
    num_kv_tokens: int  # the target's KV capacity in tokens
    max_num_seqs: int
    seed: int | None = None
    model: object = None  # the target's DecoderModel (heads share its LM head and embeddings)


def frozen_on(module: torch.nn.Module, device: torch.device, dtype: torch.dtype) -> torch.nn.Module:
    """One of the target's weight-only modules (its embedding, its LM head) for heads that
    run on `device` in `dtype`: the module itself when it lives there, a frozen copy otherwise
    (of a prepacked or quantized LM head: made from its weight). A copied LM head is prepacked where it
    can be (bf16 on the CPU: heads on the host of a GPU target), keeping its weight for the
    heads that read it."""
    if isinstance(module, QuantizedLinear):  # a quantized LM head: itself, or a float copy elsewhere
        if module.packed_device() == device:
            return module
        module = float_linear(module.dequantize(), None if module.bias is None else module.bias.detach(), False)
    if isinstance(module, PackedLinear) and (module.weight.device != device or module.weight.dtype != dtype):
        module = module.unpacked()
    if module.weight.device == device and module.weight.dtype == dtype:
        return module
    frozen = copy.deepcopy(module).to(device=device, dtype=dtype).requires_grad_(False)
    if isinstance(frozen, torch.nn.Linear) and can_prepack(dtype, device):
        return PackedLinear(frozen, keep_weight=True)
    return frozen


def prepare_head(head: torch.nn.Module, config, device: torch.device) -> str:
    """A speculation head on the CPU runs through the draft model's backend and quantization
    (--draft-backend, --draft-quantization; draft_cpu.backends), applied to its own layers
    only: the target's shared embedding and LM head are not its submodules. "auto" is the
    torch backend here (bf16 weights prepacked for oneDNN, faster for a head): IPEX made an
    EAGLE head slower (its few-row matmuls change shape every drafting step) and its bf16
    drafts a little worse (docs/speculators.md, Medusa and EAGLE heads).
    Returns a note for the start-up log ('' off the CPU)."""
    if device.type != "cpu":
        return ""
    from draft_cpu.backends import prepare_model, resolve_backend
    backend = "torch" if config.draft_backend == "auto" else resolve_backend(config.draft_backend, device)
    return prepare_model(head, backend, config.draft_quantization)


class Proposer(ABC):
    name: str = "proposer"
    needs_logits = False  # whether ProposalRequest.last_logits must be filled
    needs_hidden_states = False
    needs_features = False  # whether ProposalRequest.new_features must be filled (every committed token's)
    # with needs_features: the target layers whose inputs the features carry after the final
    # hidden state (EAGLE-3; empty = the final hidden state alone)
    feature_layers: tuple[int, ...] = ()

    @abstractmethod
    def propose(self, requests: list[ProposalRequest]) -> list[DraftTree]:
        """One tree per request, at most request.max_nodes nodes, at most tree_width children a node."""

    def draft_ahead(self, verifying: list[tuple[str, DraftTree]]):
        """The target is about to verify these (request id, tree) pairs. A proposer that can
        work meanwhile (a draft model on other cores or another device) starts and returns
        a threading.Event, which the engine sets when verification is done; None otherwise."""
        return None

    def busy_between(self, t0: float, t1: float) -> float:
        """Seconds this proposer's own worker computed within [t0, t1] (time.perf_counter);
        0 for proposers that run on the engine's thread."""
        return 0.0

    def on_accepted(self, request_id: str, token_ids: list[int], num_accepted: int) -> None:
        """The last verification kept num_accepted draft tokens; token_ids now ends with
        them plus the target's bonus or recovered token."""

    def release(self, request_id: str) -> None:
        """The request finished, was aborted or failed: drop what is kept for it."""

    def close(self) -> None:
        """The engine is shutting down: stop threads, free memory."""
