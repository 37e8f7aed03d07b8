"""EAGLE (Li et al. 2024, "EAGLE: Speculative Sampling Requires Rethinking Feature
Uncertainty") with EAGLE-2's dynamic draft trees (Li et al. 2024, "EAGLE-2: Faster
Inference of Language Models with Dynamic Draft Trees").

The head drafts at the feature level. Its input at position p is the target's feature
f_p (the final hidden state, the one the LM head reads) and the embedding of the token
at p + 1; `fc` projects their concatenation [embed, feature] to the hidden size, one
decoder layer (the target's shapes, no input norm) runs over the head's own KV cache,
and its output is a guess of f_{p+1}, which the target's LM head turns into the token
at p + 2. Drafting goes on from guessed features: the next input is (guessed f_{p+1},
the drafted token at p + 2).

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
     never outvalues its parent, so they do), parents first.
Nodes are one-hot proposals, so the rejection sampler keeps greedy and sampled requests
lossless. The head's KV for drafted nodes lives past the committed positions and is
dropped after each step; committed positions never change, so there is no rollback.

The head runs where --draft-device says, on the engine's thread (it needs the verified
features, so it cannot overlap verification); with a GPU target and a CPU head the
features cross to the host each step ([tokens, H], small).

Checkpoints: ours and the public EAGLE layout are one format, names mapped explicitly:
  fc.weight [H, 2H], fc.bias [H] (optional)
  layers.0.self_attn.{q,k,v}_proj.weight (+ .bias for Qwen2), layers.0.self_attn.o_proj.weight
  layers.0.mlp.{gate,up,down}_proj.weight, layers.0.post_attention_layernorm.weight
  embed_tokens.weight (optional, ignored: the target's embedding is used)
in a .safetensors file (or pytorch_model.bin of a public checkpoint) with a config.json.
"""
from __future__ import annotations

import dataclasses
import json
import logging
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

from runtime.block_manager import BlockManager
from runtime.models.decoder import AttentionFn, DecoderLayer, RotaryEmbedding
from speculators.base import ProposalRequest, Proposer, frozen_on
from speculators.tree import DraftTree
from target_gpu.attention import AttentionMetadata, SeqAttentionInput, TorchAttentionBackend
from target_gpu.kv_cache import KVCache

log = logging.getLogger("speculators.eagle")

CONFIG_NAME = "config.json"
WEIGHTS_NAME = "model.safetensors"


# ---- the head --------------------------------------------------------------------------------

class EagleHead(nn.Module):
    """fc([embed(token), feature]) -> one decoder layer -> the next feature [T, H]."""

    def __init__(self, target_config, embed_tokens: nn.Module, lm_head: nn.Module, fc_bias: bool = True):
        super().__init__()
        self.config = dataclasses.replace(target_config, num_layers=1)
        h = self.config.hidden_size
        self.fc = nn.Linear(2 * h, h, bias=fc_bias)
        layer = DecoderLayer(self.config, 0)
        layer.input_layernorm = nn.Identity()  # EAGLE's layer reads fc's output as it is
        self.layers = nn.ModuleList([layer])
        self.rotary = RotaryEmbedding(self.config)
        self._shared = (embed_tokens, lm_head)  # the target's; not submodules, not in state_dict

    @property
    def dtype(self) -> torch.dtype:
        return self.fc.weight.dtype

    def set_shared(self, embed_tokens: nn.Module, lm_head: nn.Module) -> None:
        self._shared = (embed_tokens, lm_head)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, features: torch.Tensor,
                attention: AttentionFn) -> torch.Tensor:
        # input_ids, positions [T]; features [T, H] -> predicted next features [T, H]
        embeds = self._shared[0](input_ids).to(features.dtype)
        x = self.fc(torch.cat([embeds, features], dim=-1))
        cos, sin = self.rotary(positions, x.dtype)
        return self.layers[0](x, cos, sin, attention)

    def compute_logits(self, features: torch.Tensor) -> torch.Tensor:
        # [N, H] -> [N, V] float32, through the target's LM head
        return self._shared[1](features).float()

    def config_dict(self) -> dict:
        return {"architecture": "eagle", "hidden_size": self.config.hidden_size,
                "vocab_size": self.config.vocab_size, "fc_bias": self.fc.bias is not None,
                "target_architecture": self.config.architecture}


# public EAGLE name -> (our name, row offset, row count) for the fused q/k/v and gate/up matrices
def _fused_rows(cfg) -> dict[str, tuple[str, int, int]]:
    q, kv, inter = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim, cfg.intermediate_size
    return {"layers.0.self_attn.q_proj": ("layers.0.self_attn.qkv_proj", 0, q),
            "layers.0.self_attn.k_proj": ("layers.0.self_attn.qkv_proj", q, kv),
            "layers.0.self_attn.v_proj": ("layers.0.self_attn.qkv_proj", q + kv, kv),
            "layers.0.mlp.gate_proj": ("layers.0.mlp.gate_up_proj", 0, inter),
            "layers.0.mlp.up_proj": ("layers.0.mlp.gate_up_proj", inter, inter)}


def to_public_names(head: EagleHead) -> dict[str, torch.Tensor]:
    state = head.state_dict()
    out = {"fc.weight": state["fc.weight"]}
    if "fc.bias" in state:
        out["fc.bias"] = state["fc.bias"]
    for public, (ours, start, count) in _fused_rows(head.config).items():
        for leaf in ("weight", "bias"):
            if f"{ours}.{leaf}" in state:
                out[f"{public}.{leaf}"] = state[f"{ours}.{leaf}"].narrow(0, start, count)
    for name in ("layers.0.self_attn.o_proj.weight", "layers.0.post_attention_layernorm.weight",
                 "layers.0.mlp.down_proj.weight"):
        out[name] = state[name]
    return out


def load_public_state(head: EagleHead, tensors: dict[str, torch.Tensor], source: str) -> None:
    """Fill head from public-layout tensors; every parameter exactly once, shapes checked."""
    fused = _fused_rows(head.config)
    params = dict(head.named_parameters())
    filled: set[str] = set()
    for name, tensor in tensors.items():
        if name == "embed_tokens.weight" or name.endswith("rotary_emb.inv_freq"):
            continue  # the target's embedding is used; rotary tables are computed
        if name == "layers.0.input_layernorm.weight":
            raise ValueError(f"{source}: this EAGLE head normalises its layer input (layers.0.input_layernorm); "
                             "only EAGLE-1/2 heads without it are supported")
        prefix, _, leaf = name.rpartition(".")
        if prefix in fused:
            ours, start, count = fused[prefix]
            target = f"{ours}.{leaf}"
        else:
            target, start, count = name, None, None
        if target not in params:
            raise ValueError(f"{source}: unexpected tensor {name!r} for an EAGLE head")
        dest = params[target].data if start is None else params[target].data.narrow(0, start, count)
        if tuple(dest.shape) != tuple(tensor.shape):
            raise ValueError(f"{source}: {name!r} has shape {tuple(tensor.shape)}, the target needs "
                             f"{tuple(dest.shape)}")
        dest.copy_(tensor)
        filled.add(name)
    expected = set(to_public_names(head))
    missing = sorted(expected - filled)
    if missing:
        raise ValueError(f"{source}: missing {', '.join(missing[:4])}" + (" ..." if len(missing) > 4 else ""))


def save_head(head: EagleHead, directory: str | Path, extra_config: dict | None = None) -> Path:
    from safetensors.torch import save_file
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    tensors = {n: t.detach().contiguous().cpu() for n, t in to_public_names(head).items()}
    save_file(tensors, str(directory / WEIGHTS_NAME))
    (directory / CONFIG_NAME).write_text(json.dumps({**head.config_dict(), **(extra_config or {})}, indent=2))
    return directory


def _read_tensors(path: Path) -> dict[str, torch.Tensor]:
    if path.suffix == ".safetensors":
        from safetensors.torch import load_file
        return load_file(str(path))
    return torch.load(str(path), map_location="cpu", weights_only=True)


def load_head(path: str | Path, target_config, embed_tokens: nn.Module, lm_head: nn.Module) -> EagleHead:
    """An EAGLE head from a directory (model.safetensors, or any .safetensors or
    pytorch_model.bin in it) or a weights file, checked against the target's shapes."""
    path = Path(path)
    if path.is_dir():
        files = ([path / WEIGHTS_NAME] if (path / WEIGHTS_NAME).exists() else
                 sorted(path.glob("*.safetensors")) or sorted(path.glob("pytorch_model*.bin")))
        if not files:
            raise ValueError(f"no .safetensors or pytorch_model.bin in EAGLE checkpoint directory {str(path)!r}")
        weights = files[0]
    elif path.exists():
        weights = path
    else:
        raise ValueError(f"EAGLE checkpoint {str(path)!r} does not exist")
    tensors = _read_tensors(weights)
    config_file = weights.parent / CONFIG_NAME
    config = json.loads(config_file.read_text()) if config_file.exists() else {}
    for key in ("hidden_size", "vocab_size"):
        if key in config and int(config[key]) != getattr(target_config, key):
            raise ValueError(f"EAGLE checkpoint {str(path)!r} has {key} {config[key]}, the target "
                             f"{getattr(target_config, key)}")
    head = EagleHead(target_config, embed_tokens, lm_head, fc_bias="fc.bias" in tensors)
    load_public_state(head, tensors, str(weights))
    return head


# ---- the proposer ----------------------------------------------------------------------------------

@dataclass(slots=True)
class _HeadSeq:
    """One request in the head's cache (the fields BlockManager reads). Head position p
    holds the input (f_p, token p + 1); positions [0, num_computed_tokens) are cached."""

    block_table: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    features: dict[int, torch.Tensor] = field(default_factory=dict)  # position -> f_p [H], not yet fed


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

    def __init__(self, head: EagleHead, device: torch.device, depth: int = 5, num_kv_tokens: int = 65536,
                 block_size: int = 16):
        self.head = head.eval()
        self.device = device
        self.depth = depth
        self.block_size = block_size
        num_blocks = max(1, -(-num_kv_tokens // block_size))
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
        fed = self._feed(requests)  # request index -> (predicted feature [H], depth-1 log-probs [V])
        return self._expand(requests, fed)

    # ---- 1. feed the committed features ----------------------------------------------------------
    def _feed(self, requests: list[ProposalRequest]) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
        runs = []  # (request index, seq, first position, feature rows [n, H], token ids [n])
        for i, r in enumerate(requests):
            seq = self.seqs.setdefault(r.request_id, _HeadSeq())
            for start, rows in r.new_features:
                for j in range(rows.shape[0]):
                    seq.features[start + j] = rows[j]
                seq.num_computed_tokens = min(seq.num_computed_tokens, start)  # recomputed (after preemption)
            last = len(r.token_ids) - 2  # the newest position with a feature (the last token has none yet)
            first = min(seq.num_computed_tokens, last)  # nothing new: run the last position again
            for p in [p for p in seq.features if p < first]:
                del seq.features[p]
            if last < 0 or any(p not in seq.features for p in range(first, last + 1)):
                continue  # features missing (the head joined mid-request): nothing to draft from
            if not self.block_manager.can_allocate(seq, last + 1 - seq.num_computed_tokens):
                continue
            feats = torch.stack([seq.features.pop(p) for p in range(first, last)] + [seq.features[last]])  # [n, H]
            seq.features[last] = seq.features[last].clone()  # kept (for a rerun), without the chunk it views
            runs.append((i, seq, first, feats, r.token_ids[first + 1:last + 2]))
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
        out = self._run(ids, positions, torch.cat(features), slots, inputs)  # [T, H]
        predicted = out[last_rows]  # [B, H]
        logprobs = self.head.compute_logits(predicted).log_softmax(dim=-1)  # [B, V]
        return {i: (predicted[b], logprobs[b]) for b, (i, *_rest) in enumerate(runs)}

    # ---- 2. and 3. EAGLE-2 expansion and rerank -----------------------------------------------------
    def _expand(self, requests: list[ProposalRequest], fed) -> list[DraftTree]:
        states = {}  # request index -> (nodes, frontier feature per node index)
        for i, (feature, logprobs) in fed.items():
            r = requests[i]
            top = logprobs.topk(max(1, r.tree_width))
            nodes = [_Node(float(v.exp()), 1, int(t), -1) for v, t in zip(top.values, top.indices)]
            states[i] = (nodes, {k: feature for k in range(len(nodes))})  # depth-1 inputs read the fed feature
        for depth in range(2, self.depth + 1):
            batch = []  # (request index, node indices to expand)
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
                if chosen and self.block_manager.can_allocate(seq, expanded + len(chosen)):
                    batch.append((i, chosen))
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
            mask = torch.zeros(len(chosen), seq_len, dtype=torch.bool)  # [Q, L]
            mask[:, :base] = True
            for row, k in enumerate(chosen):
                node = k
                while node >= 0:
                    mask[row, base + nodes[node].slot_index] = True
                    node = nodes[node].parent
            inputs.append(SeqAttentionInput(len(ids), len(chosen), seq_len, seq.block_table, mask))
            for k in chosen:
                ids.append(nodes[k].token)
                positions.append(base - 1 + nodes[k].depth)  # node at depth d holds token base + d
                slots.append(self.block_manager.slot(seq, base + nodes[k].slot_index))
                features.append(parent_feature[k])
                owners.append((i, k))
            seq.num_computed_tokens = base  # the drafted inputs are scratch, past the committed ones
        out = self._run(ids, positions, torch.stack(features), slots, inputs)  # [T, H]
        logprobs = self.head.compute_logits(out).log_softmax(dim=-1)  # [T, V]
        widths = [max(1, requests[i].tree_width) for i, _ in owners]
        top = logprobs.topk(max(widths), dim=-1)
        values, tokens = top.values.exp().tolist(), top.indices.tolist()
        for row, ((i, k), width) in enumerate(zip(owners, widths)):
            nodes, parent_feature = states[i]
            for v, t in zip(values[row][:width], tokens[row][:width]):
                nodes.append(_Node(nodes[k].value * v, nodes[k].depth + 1, t, k))
                parent_feature[len(nodes) - 1] = out[row]

    def _run(self, ids, positions, features, slots, inputs) -> torch.Tensor:
        device = self.device
        meta = AttentionMetadata.build(inputs, torch.tensor(slots, dtype=torch.long, device=device), self.block_size,
                                       self.head.config.num_heads // self.head.config.num_kv_heads, device)
        backend = self.attention

        def attention(layer_idx, q, k, v):
            return backend.forward(layer_idx, q, k, v, meta)

        return self.head(torch.tensor(ids, dtype=torch.long, device=device),
                         torch.tensor(positions, dtype=torch.long, device=device),
                         features.to(device=device, dtype=self.head.dtype), attention)


def _best_tree(nodes: list[_Node], max_nodes: int) -> DraftTree:
    """The best max_nodes nodes by value (parents outrank their children), parents first."""
    order = sorted(range(len(nodes)), key=lambda k: (-nodes[k].value, nodes[k].depth, k))
    keep = sorted(order[:max_nodes], key=lambda k: (nodes[k].depth, -nodes[k].value, k))
    index = {old: new for new, old in enumerate(keep)}
    return DraftTree([nodes[k].token for k in keep],
                     [-1 if nodes[k].parent < 0 else index[nodes[k].parent] for k in keep])


_EMPTY = DraftTree([], [])


def build_eagle_proposer(config, target) -> EagleProposer:
    """The head of config.eagle_head where config.draft_device says, sharing the target's
    embedding and LM head (copied there when the device or dtype differs)."""
    if not config.eagle_head:
        raise ValueError("speculator 'eagle' needs a trained head: --eagle-head DIR (see scripts/train_eagle.py)")
    model = target.model
    device = config.resolved_draft_device(target.device)
    dtype = getattr(torch, config.resolved_draft_dtype(device, target.device, target.dtype))
    embed, lm_head = frozen_on(model.embed_tokens, device, dtype), frozen_on(model.lm_head, device, dtype)
    head = load_head(config.eagle_head, model.config, embed, lm_head).to(device=device, dtype=dtype)
    num_kv_tokens = target.num_kv_tokens + target.max_num_seqs * (config.speculative_tokens("eagle") * 8
                                                                  + config.block_size)
    log.info("EAGLE head on %s in %s; EAGLE-2 trees %d deep", device, str(dtype).replace("torch.", ""),
             config.eagle_depth)
    return EagleProposer(head, device, config.eagle_depth, num_kv_tokens, config.block_size)
