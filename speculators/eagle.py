"""EAGLE (Li et al. 2024, "EAGLE: Speculative Sampling Requires Rethinking Feature
Uncertainty") with EAGLE-2's dynamic draft trees (Li et al. 2024, "EAGLE-2: Faster
Inference of Language Models with Dynamic Draft Trees").

The head drafts from the target's features. Its input at position p is a state made
from the target's features at p (EAGLE-1: the final hidden state; EAGLE-3: three layers'
inputs, projected) and the embedding of the token at p + 1; one decoder layer runs over
the head's own KV cache, and its output state gives the distribution of the token at
p + 2. Drafting goes on from its own states: the next input is (its output state, the
drafted token at p + 2).

Per step and sequence (all sequences batched in each head forward):
  1. feed: every position whose feature the target produced since the last step (the
     prompt after prefill, then the verified root and accepted nodes), as one causal
     chunk; its last output gives the depth-1 distribution;
  2. EAGLE-2 expansion, up to `depth` times: the `top_k` likeliest nodes of the newest
     depth (value = product of the draft probabilities along the path) run through the
     head in one forward (tree attention: each sees the committed context and its
     ancestors), and each gets its `top_k` likeliest children. Nodes that cannot beat
     the budget's cut are not expanded (their children score lower still), so a
     confident budget-sized tree stops early;
  3. rerank: of all nodes made, the best `max_nodes` by value form the tree (a child
     never outvalues its parent, so they do), in the order of their value: the first n
     are the best n-node tree (runtime.speculation reads what each node is worth).
Nodes are one-hot proposals, so the rejection sampler keeps greedy and sampled requests
lossless. The head's KV for drafted nodes lives past the committed positions and is
dropped after each step; committed positions never change, so there is no rollback.

The head runs where --draft-device says, on the engine's thread (it needs the verified
features, so it cannot overlap verification); with a GPU target and a CPU head the
features cross to the host each step ([tokens, H], small).

The heads (EAGLE-1/2's and EAGLE-3's) and their checkpoints: speculators/eagle_heads.py.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, field

import torch

from runtime.block_manager import BlockManager
from speculators.base import ProposalRequest, Proposer, frozen_on, prepare_head
from speculators.eagle_heads import Eagle3Head, EagleHead, load_head
from speculators.heads import shipped_eagle_head
from runtime.draft_tree import DraftTree
from runtime.models.tensor_parallel import VocabParallelEmbedding
from target_gpu.attention import AttentionMetadata, SeqAttentionInput, TorchAttentionBackend
from target_gpu.kv_cache import KVCache, bytes_per_block, mirror_pool_blocks
from speculators.registry import Setting, Speculator
from speculators.settings import DRAFT_PLACEMENT

log = logging.getLogger("speculators.eagle")


# ---- the proposer ----------------------------------------------------------------------------------

@dataclass(slots=True)
class _HeadSeq:
    """One request in the head's cache (the fields BlockManager reads). Head position p
    holds the input (f_p, token p + 1); positions [0, num_computed_tokens) are cached."""

    block_table: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    features: dict[int, torch.Tensor] = field(default_factory=dict)  # position -> f_p [F], not yet fed
    num_freed_blocks: int = 0  # BlockManager's: none here (the head's cache keeps every block)


@dataclass(slots=True)
class _Node:
    value: float  # product of draft probabilities along the path
    depth: int
    token: int
    parent: int  # node index, -1 = the root
    slot_index: int = -1  # once expanded: its input's index past the committed positions


class EagleProposer(Proposer):
    name = "eagle"
    needs_features = True  # ProposalRequest.new_features: the target's feature of every committed token

    def __init__(self, head: EagleHead | Eagle3Head, device: torch.device, depth: int = 5,
                 num_kv_tokens: int = 65536, block_size: int = 16, kv_memory_fraction: float = 1.0):
        self.head = head.eval()
        self.feature_layers = head.feature_layers  # EAGLE-3: the target layers whose inputs it reads
        self.device = device
        self.depth = depth
        self.block_size = block_size
        num_blocks = mirror_pool_blocks(num_kv_tokens, block_size, bytes_per_block(head.config, block_size, head.dtype),
                                        device, kv_memory_fraction, "EAGLE head")
        self.kv_cache = KVCache(head.config, num_blocks, block_size, head.dtype, device)
        self.attention = TorchAttentionBackend(self.kv_cache)
        self.block_manager = BlockManager(num_blocks, block_size)
        self.seqs: dict[str, _HeadSeq] = {}

    def release(self, request_id: str) -> None:
        seq = self.seqs.pop(request_id, None)
        if seq is not None:
            self.block_manager.free(seq)

    @torch.inference_mode()
    def propose(self, requests: list[ProposalRequest]) -> list[DraftTree]:
        fed = self._feed(requests)  # request index -> (output state [h], depth-1 log-probs [Vd])
        return self._expand(requests, fed)

    # ---- 1. feed the committed features ----------------------------------------------------------
    def _feed(self, requests: list[ProposalRequest]) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
        ready = []  # (request index, seq, first position, last position): features there to run
        for i, r in enumerate(requests):
            seq = self.seqs.setdefault(r.request_id, _HeadSeq())
            for start, hidden in r.new_features:
                rows = self.head.target_features(hidden)  # [n, F]
                for j in range(rows.shape[0]):
                    seq.features[start + j] = rows[j]
                seq.num_computed_tokens = min(seq.num_computed_tokens, start)  # recomputed (after preemption)
            last = len(r.token_ids) - 2  # the newest position with a feature (the last token has none yet)
            first = min(seq.num_computed_tokens, last)  # nothing new: run the last position again
            for p in [p for p in seq.features if p < first]:
                del seq.features[p]
            if last < 0 or any(p not in seq.features for p in range(first, last + 1)):
                continue  # features missing (the head joined mid-request): nothing to draft from
            ready.append((i, seq, first, last))
        runs = []  # (request index, seq, first position, feature rows [n, H], token ids [n])
        fits = self.block_manager.fitting([(seq, last + 1 - seq.num_computed_tokens) for _, seq, _, last in ready])
        for (i, seq, first, last), fit in zip(ready, fits):
            if not fit:
                continue
            feats = torch.stack([seq.features.pop(p) for p in range(first, last)] + [seq.features[last]])  # [n, F]
            seq.features[last] = seq.features[last].clone()  # kept (for a rerun), without the chunk it views
            runs.append((i, seq, first, feats, requests[i].token_ids[first + 1:last + 2]))
        if not runs:
            return {}
        ids, positions, features, slots, inputs, last_rows = [], [], [], [], [], []
        for i, seq, first, feats, tokens in runs:
            n = feats.shape[0]
            seq.num_computed_tokens = first
            self.block_manager.may_append(seq, n)
            inputs.append(SeqAttentionInput(len(ids), n, first + n, seq.block_table))
            ids.extend(tokens)
            positions.extend(range(first, first + n))
            slots.extend(self.block_manager.slot(seq, p) for p in range(first, first + n))
            features.append(feats)
            last_rows.append(len(ids) - 1)
            seq.num_computed_tokens = first + n
        states = self.head.project(torch.cat(features).to(device=self.device, dtype=self.head.dtype))  # [T, h]
        out = self._run(ids, positions, states, slots, inputs)  # [T, h]
        predicted = out[last_rows]  # [B, h]
        logprobs = self.head.draft_logits(predicted).log_softmax(dim=-1)  # [B, Vd]
        return {i: (predicted[b], logprobs[b]) for b, (i, *_rest) in enumerate(runs)}

    # ---- 2. and 3. EAGLE-2 expansion and rerank -----------------------------------------------------
    def _expand(self, requests: list[ProposalRequest], fed) -> list[DraftTree]:
        states = {}  # request index -> (nodes, frontier feature per node index)
        for i, (feature, logprobs) in fed.items():
            r = requests[i]
            top = logprobs.topk(max(1, r.tree_width))
            tokens = self.head.target_ids(top.indices)
            nodes = [_Node(float(v.exp()), 1, int(t), -1) for v, t in zip(top.values, tokens)]
            states[i] = (nodes, {k: feature for k in range(len(nodes))})  # depth-1 inputs read the fed feature
        for depth in range(2, self.depth + 1):
            wanted = []  # (request index, node indices to expand, seq, its new inputs)
            for i, (nodes, parent_feature) in states.items():
                r = requests[i]
                if depth > r.max_nodes:  # no node this deep fits the budget
                    continue
                # a child never outvalues its parent: expand only nodes that beat the current cut
                cut = sorted((node.value for node in nodes), reverse=True)[r.max_nodes - 1] \
                    if len(nodes) >= r.max_nodes else -1.0
                newest = [k for k, node in enumerate(nodes) if node.depth == depth - 1 and node.value > cut]
                chosen = sorted(newest, key=lambda k: -nodes[k].value)[:max(1, r.tree_width)]
                seq = self.seqs[r.request_id]
                expanded = sum(1 for node in nodes if node.slot_index >= 0)
                if chosen:
                    wanted.append((i, chosen, seq, expanded + len(chosen)))
            fits = self.block_manager.fitting([(seq, n) for _, _, seq, n in wanted])
            batch = [(i, chosen) for (i, chosen, _, _), fit in zip(wanted, fits) if fit]
            if not batch:
                break
            self._expand_depth(requests, states, batch)
        trees = [_EMPTY] * len(requests)
        for i, (nodes, _) in states.items():
            trees[i] = _best_tree(nodes, requests[i].max_nodes)
            seq = self.seqs[requests[i].request_id]
            self.block_manager.truncate(seq, seq.num_computed_tokens)  # drop the drafted nodes' KV
        return trees

    def _expand_depth(self, requests, states, batch) -> None:
        """Run the chosen nodes through the head (each sees the committed positions and its
        expanded ancestors) and give each its top children."""
        ids, positions, features, slots, inputs, owners = [], [], [], [], [], []
        for i, chosen in batch:
            nodes, parent_feature = states[i]
            seq = self.seqs[requests[i].request_id]
            base = seq.num_computed_tokens  # committed positions 0..base-1
            used = sum(1 for node in nodes if node.slot_index >= 0)
            self.block_manager.may_append(seq, used + len(chosen))  # slots base + used .. for the new inputs
            for j, k in enumerate(chosen):
                nodes[k].slot_index = used + j
            seq_len = base + used + len(chosen)
            mask = torch.zeros(len(chosen), used + len(chosen), dtype=torch.bool)  # [Q, M] past the committed keys
            for row, k in enumerate(chosen):
                node = k
                while node >= 0:
                    mask[row, nodes[node].slot_index] = True
                    node = nodes[node].parent
            inputs.append(SeqAttentionInput(len(ids), len(chosen), seq_len, seq.block_table, mask))
            for k in chosen:
                ids.append(nodes[k].token)
                positions.append(base - 1 + nodes[k].depth)  # node at depth d holds token base + d
                slots.append(self.block_manager.slot(seq, base + nodes[k].slot_index))
                features.append(parent_feature[k])
                owners.append((i, k))
            seq.num_computed_tokens = base  # the drafted inputs are scratch, past the committed ones
        out = self._run(ids, positions, torch.stack(features), slots, inputs)  # [T, h]
        logprobs = self.head.draft_logits(out).log_softmax(dim=-1)  # [T, Vd]
        widths = [max(1, requests[i].tree_width) for i, _ in owners]
        top = logprobs.topk(max(widths), dim=-1)
        values, tokens = top.values.exp().tolist(), self.head.target_ids(top.indices).tolist()
        for row, ((i, k), width) in enumerate(zip(owners, widths)):
            nodes, parent_feature = states[i]
            for v, t in zip(values[row][:width], tokens[row][:width]):
                nodes.append(_Node(nodes[k].value * v, nodes[k].depth + 1, t, k))
                parent_feature[len(nodes) - 1] = out[row]

    def _run(self, ids, positions, states, slots, inputs) -> torch.Tensor:
        # states [T, h] on the head's device, in its dtype -> output states [T, h]
        device = self.device
        meta = AttentionMetadata.build(inputs, torch.tensor(slots, dtype=torch.long, device=device), self.block_size,
                                       self.head.config.num_heads // self.head.config.num_kv_heads, device)
        backend = self.attention

        def attention(layer_idx, q, k, v):
            return backend.forward(layer_idx, q, k, v, meta)

        return self.head(torch.tensor(ids, dtype=torch.long, device=device),
                         torch.tensor(positions, dtype=torch.long, device=device), states, attention)


def _best_tree(nodes: list[_Node], max_nodes: int) -> DraftTree:
    """The best max_nodes nodes, in the order of their value: a child never outvalues its
    parent, so parents come first, and the first n nodes are the best n-node tree."""
    keep = sorted(range(len(nodes)), key=lambda k: (-nodes[k].value, nodes[k].depth, k))[:max_nodes]
    index = {old: new for new, old in enumerate(keep)}
    return DraftTree([nodes[k].token for k in keep],
                     [-1 if nodes[k].parent < 0 else index[nodes[k].parent] for k in keep])


_EMPTY = DraftTree([], [])
DEFAULT_DEPTH = 5  # EAGLE-2 expansion steps, the deepest draft


def build_eagle_proposer(config, target) -> EagleProposer:
    """The head of config.eagle_head (else the head shipped for the default model:
    speculators.heads) where config.draft_device says, sharing the target's embedding and
    LM head (copied there when the device or dtype differs)."""
    path = config.eagle_head or shipped_eagle_head(config.model)
    if not path:
        raise ValueError("speculator 'eagle' needs a trained head: --eagle-head DIR (see scripts/train_eagle.py)")
    log.info("EAGLE head: %s (%s)", path, "--eagle-head" if config.eagle_head else
             "shipped for the default model: speculators/heads")
    model = target.model
    if isinstance(model.embed_tokens, VocabParallelEmbedding):
        raise ValueError("speculator 'eagle' reads the target's embedding and LM head, which tensor parallelism "
                         "splits over the ranks: not supported yet with --tensor-parallel-size > 1")
    device = config.resolved_draft_device(target.device)
    dtype = getattr(torch, config.resolved_draft_dtype(device, target.device, target.dtype))
    head = load_head(path, model.config, model.embed_tokens, model.lm_head).to(device=device, dtype=dtype)
    uses_lm_head = isinstance(head, EagleHead)  # an EAGLE-3 head has its own
    head.set_shared(frozen_on(model.embed_tokens, device, dtype),
                    frozen_on(model.lm_head, device, dtype) if uses_lm_head else None)
    backend = prepare_head(head.eval(), config, device)
    num_kv_tokens = target.num_kv_tokens + target.max_num_seqs * (config.speculative_tokens("eagle") * 8
                                                                  + config.block_size)
    log.info("%s head on %s in %s%s; EAGLE-2 trees %d deep", "EAGLE" if uses_lm_head else
             f"EAGLE-3 (target layers {head.feature_layers}, {head.draft_vocab_size} draft tokens)", device,
             str(dtype).replace("torch.", ""), f" ({backend})" if backend else "", config.eagle_depth)
    return EagleProposer(head, device, config.eagle_depth, num_kv_tokens, config.block_size,
                         config.draft_kv_fraction(device, target.device))


SPECULATOR = Speculator(
    "eagle", build_eagle_proposer, num_speculative_tokens=16, tree_width=4,
    settings=(Setting("eagle_head", None, "speculator eagle: a trained EAGLE head (a directory or file in the "
                      "public EAGLE layout; python -m scripts.train_eagle makes one; default: the EAGLE-3 head "
                      "shipped for the default model); it runs where --draft-device says"),
              Setting("eagle_depth", DEFAULT_DEPTH, "speculator eagle: EAGLE-2 expansion steps, the deepest draft; "
                      "--speculative-tree-width is the top-k expanded per step", int, minimum=1),
              *DRAFT_PLACEMENT),
    requires=lambda config: None if config.eagle_head or shipped_eagle_head(config.model) else (
        "a trained head: --eagle-head DIR (or eagle_head=...; python -m scripts.train_eagle trains one)"),
    loads_weights=True)
