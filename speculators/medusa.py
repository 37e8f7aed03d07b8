"""Medusa (Cai et al. 2024, "Medusa: Simple LLM Inference Acceleration Framework with
Multiple Decoding Heads"): K small heads on the target's last hidden state guess the
tokens after the next one, and a static tree of their top candidates is verified in one
target pass.

Head k (k = 0..K-1) reads the final hidden state h_p (after the last norm) that gave the
target's token at p + 1 and predicts the token at p + 2 + k: L residual blocks
(x + SiLU(W x + b)) and then a vocabulary projection, its own or, as an option, the
target's LM head (shared: no extra memory, and training only touches the small blocks).
At proposal time the sequence ends with that token at p + 1 (the bonus or recovered
token of the last step: the tree's root), so head k proposes the tree's depth k + 1.

As an option (on in heads trained here), every head also reads that root token: its first
block adds the token's embedding (the target's, shared) through a linear map of its own,
x + SiLU(W x + U e(t_p+1) + b), U started at zero. h_p only says what the target was
likely to write at p + 1; the heads then know what it did write (a sampled token, or the
argmax they would otherwise have to decode from h_p), which is what EAGLE's head reads
for the same reason (Li et al. 2024) and the first of the tokens Hydra's heads read (Ankner
et al. 2024). The tree stays static, drawn from one pass of the heads.

The tree is a list of paths of top-k ranks (Medusa's "choices": (0,) is head 0's best
token, (0, 1) head 1's second best below it, ...), compiled once into parents and ranks.
Per step and sequence its nodes get a value, the product of the heads' probabilities
along the path, and the best `max_nodes` are kept (a child never outvalues its parent,
so they form a tree); nodes ranked beyond the request's tree width are left out. The
proposals are deterministic (one-hot), so the rejection sampler stays lossless for
greedy and sampled requests alike. Medusa's "typical acceptance" is lossy and is not
offered.

Checkpoints use the public Medusa layout, names mapped explicitly:
  medusa_head.{k}.{j}.linear.weight / .bias  (block j of head k, j < L)
  medusa_head.{k}.0.token_linear.weight      (ours: U, when the heads read the root token)
  medusa_head.{k}.{L}.weight                 (head k's projection; absent when shared)
  d2t                                        (ours, EAGLE-3's name: the draft vocabulary,
                                              absent when it is the whole vocabulary)
with a config.json of medusa_num_heads, medusa_num_layers (and here hidden_size,
vocab_size, draft_vocab_size, share_lm_head, reads_token). With a draft vocabulary a shared projection
is the target LM head's rows of those tokens.
"""
from __future__ import annotations

import itertools
import json
import logging
import re
from pathlib import Path

import torch
from torch import nn

from speculators.base import ProposalRequest, Proposer, frozen_on
from speculators.draft_vocab import DraftVocabulary
from runtime.draft_tree import DraftTree
from runtime.models.packed_linear import apply_linear
from speculators.registry import Setting, Speculator
from speculators.settings import DRAFT_PLACEMENT

log = logging.getLogger("speculators.medusa")

Choice = tuple[int, ...]
CONFIG_NAME = "config.json"
WEIGHTS_NAME = "medusa_lm_head.safetensors"


# ---- the heads ------------------------------------------------------------------------------

class ResBlock(nn.Module):
    """x + SiLU(W x + b), or with reads_token x + SiLU(W x + U e + b) for a token embedding e."""

    def __init__(self, hidden_size: int, reads_token: bool = False):
        super().__init__()
        self.linear = nn.Linear(hidden_size, hidden_size)
        nn.init.zeros_(self.linear.weight)  # a fresh head starts as the identity (Medusa's init)
        self.token_linear = nn.Linear(hidden_size, hidden_size, bias=False) if reads_token else None
        if self.token_linear is not None:
            nn.init.zeros_(self.token_linear.weight)  # and ignores the token until trained to read it

    def forward(self, x: torch.Tensor, token_embeds: torch.Tensor | None = None) -> torch.Tensor:
        pre = self.linear(x)
        if self.token_linear is not None:
            pre = pre + self.token_linear(token_embeds)
        return x + nn.functional.silu(pre)


class MedusaHeads(DraftVocabulary, nn.Module):
    """K heads; forward(hidden [N, H], root tokens [N]) -> logits [N, K, Vd] (float32) over
    the draft vocabulary: all V target tokens, or the Vd < V tokens the target writes most
    (draft id i is target token i + d2t[i], as in EAGLE-3's layout; a smaller projection,
    6x cheaper at Vd = 8192 for a 49,152-token target). The root tokens (target ids) are
    read only with reads_token, through `embedding`, the target's token embedding."""

    def __init__(self, hidden_size: int, vocab_size: int, num_heads: int, num_layers: int = 1,
                 shared_lm_head: nn.Module | None = None, draft_vocab_size: int | None = None,
                 reads_token: bool = False, embedding: nn.Module | None = None):
        super().__init__()
        if num_heads < 1 or num_layers < 0:
            raise ValueError(f"need num_heads >= 1 and num_layers >= 0, got {num_heads} and {num_layers}")
        if reads_token and num_layers < 1:
            raise ValueError("Medusa heads that read the root token need num_layers >= 1")
        self.hidden_size, self.vocab_size = hidden_size, vocab_size
        self.num_heads, self.num_layers, self.reads_token = num_heads, num_layers, reads_token
        self.blocks = nn.ModuleList(
            nn.Sequential(*(ResBlock(hidden_size, reads_token and j == 0) for j in range(num_layers)))
            for _ in range(num_heads))
        self._embedding = (embedding,)  # the target's, not a submodule (as the shared LM head)
        draft_vocab_size = draft_vocab_size or vocab_size
        self.init_draft_vocab(vocab_size, draft_vocab_size)
        self.lm_heads = None if shared_lm_head is not None else nn.ModuleList(
            nn.Linear(hidden_size, draft_vocab_size, bias=False) for _ in range(num_heads))
        # the shared LM head's rows of the draft vocabulary [Vd, H] (derived, not saved)
        self.register_buffer("_shared_rows", torch.empty(0), persistent=False)
        self._shared = (shared_lm_head,)  # a tuple: not a submodule, so not in state_dict or parameters()
        self.on_draft_vocab_change()

    @property
    def shares_lm_head(self) -> bool:
        return self.lm_heads is None

    def set_embedding(self, embedding: nn.Module) -> None:
        self._embedding = (embedding,)

    def set_shared_lm_head(self, lm_head: nn.Module) -> None:
        self._shared = (lm_head,)
        self.on_draft_vocab_change()

    def on_draft_vocab_change(self) -> None:
        lm_head = self._shared[0]
        if lm_head is None or self.draft_vocab_size == self.vocab_size:
            self._shared_rows = torch.empty(0, device=self.d2t.device)
            return
        ids = self.target_ids(torch.arange(self.draft_vocab_size, device=self.d2t.device))
        self._shared_rows = lm_head.weight.detach()[ids.to(lm_head.weight.device)].clone()  # [Vd, H]

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs):
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)
        self.refresh_draft_vocab()

    def features(self, hidden: torch.Tensor, tokens: torch.Tensor | None = None) -> torch.Tensor:
        """hidden [N, H] (and the root tokens [N] with reads_token) -> each head's input to
        its projection [N, K, H]."""
        token_embeds = None
        if self.reads_token:
            if tokens is None or self._embedding[0] is None:
                raise ValueError("these Medusa heads read the root token: pass the tokens and set the embedding")
            token_embeds = self._embedding[0](tokens.to(hidden.device)).to(hidden.dtype)  # [N, H]
        out = []
        for block in self.blocks:
            x = hidden
            for j, res in enumerate(block):
                x = res(x, token_embeds if j == 0 else None)
            out.append(x)
        return torch.stack(out, dim=1)

    def project(self, features: torch.Tensor) -> torch.Tensor:
        """[N, K, H] -> logits over the draft vocabulary [N, K, Vd] (float32)."""
        if self.lm_heads is not None:
            return torch.stack([head(features[:, k]) for k, head in enumerate(self.lm_heads)], dim=1).float()
        if self._shared_rows.numel():
            return nn.functional.linear(features, self._shared_rows.to(features.dtype)).float()
        return apply_linear(self._shared[0], features).float()  # the shared head may be another dtype

    def forward(self, hidden: torch.Tensor, tokens: torch.Tensor | None = None) -> torch.Tensor:
        return self.project(self.features(hidden, tokens))

    def config_dict(self) -> dict:
        return {"architecture": "medusa", "medusa_num_heads": self.num_heads, "medusa_num_layers": self.num_layers,
                "hidden_size": self.hidden_size, "vocab_size": self.vocab_size,
                "draft_vocab_size": self.draft_vocab_size, "share_lm_head": self.shares_lm_head,
                "reads_token": self.reads_token}


# ---- checkpoints (public Medusa layout) ---------------------------------------------------------

def to_public_names(heads: MedusaHeads) -> dict[str, torch.Tensor]:
    out = {}
    for k, block in enumerate(heads.blocks):
        for j, res in enumerate(block):
            out[f"medusa_head.{k}.{j}.linear.weight"] = res.linear.weight
            out[f"medusa_head.{k}.{j}.linear.bias"] = res.linear.bias
            if res.token_linear is not None:
                out[f"medusa_head.{k}.{j}.token_linear.weight"] = res.token_linear.weight
        if heads.lm_heads is not None:
            out[f"medusa_head.{k}.{heads.num_layers}.weight"] = heads.lm_heads[k].weight
    if heads.draft_vocab_size < heads.vocab_size:
        out["d2t"] = heads.d2t
    return out


_PUBLIC_NAME = re.compile(r"^(?:.*\.)?medusa_head\.(\d+)\.(\d+)\."
                          r"(linear\.weight|linear\.bias|token_linear\.weight|weight)$")


def from_public_names(tensors: dict[str, torch.Tensor], num_layers: int) -> dict[str, torch.Tensor]:
    """Public names -> MedusaHeads.state_dict() names; ValueError on a name that fits neither."""
    out = {}
    for name, tensor in tensors.items():
        if name == "d2t":
            out[name] = tensor
            continue
        match = _PUBLIC_NAME.match(name)
        if match is None:
            raise ValueError(f"unexpected tensor {name!r} in a Medusa checkpoint (expected medusa_head.K.J.*)")
        k, j, leaf = int(match[1]), int(match[2]), match[3]
        if leaf == "weight" and j == num_layers:
            out[f"lm_heads.{k}.weight"] = tensor
        elif leaf != "weight" and j < num_layers:
            out[f"blocks.{k}.{j}.{leaf}"] = tensor
        else:
            raise ValueError(f"tensor {name!r} does not fit {num_layers} residual block(s) per head")
    return out


def save_heads(heads: MedusaHeads, directory: str | Path, extra_config: dict | None = None) -> Path:
    from safetensors.torch import save_file
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    tensors = {name: t.detach().contiguous().cpu() for name, t in to_public_names(heads).items()}
    save_file(tensors, str(directory / WEIGHTS_NAME))
    (directory / CONFIG_NAME).write_text(json.dumps({**heads.config_dict(), **(extra_config or {})}, indent=2))
    return directory


def _checkpoint_files(path: Path) -> tuple[Path, Path | None]:
    """(weights file, config file or None) of a checkpoint directory or weights file."""
    if path.is_dir():
        candidates = sorted(path.glob("*.safetensors"))
        if not candidates:
            raise ValueError(f"no .safetensors file in Medusa checkpoint directory {str(path)!r}")
        weights = path / WEIGHTS_NAME if (path / WEIGHTS_NAME).exists() else candidates[0]
        config = path / CONFIG_NAME
        return weights, config if config.exists() else None
    if not path.exists():
        raise ValueError(f"Medusa checkpoint {str(path)!r} does not exist")
    config = path.parent / CONFIG_NAME
    return path, config if config.exists() else None


def load_heads(path: str | Path, hidden_size: int, vocab_size: int, lm_head: nn.Module,
               embedding: nn.Module | None = None) -> MedusaHeads:
    """Heads from a checkpoint in the public layout, checked against the target's shapes;
    lm_head is the target's, used when the checkpoint shares it, and embedding its token
    embedding, used when the heads read the root token."""
    from safetensors.torch import load_file
    weights_file, config_file = _checkpoint_files(Path(path))
    tensors = load_file(str(weights_file))
    config = json.loads(config_file.read_text()) if config_file else {}
    indices = [_PUBLIC_NAME.match(n) for n in tensors if n != "d2t"]
    if not indices or not all(indices):
        raise ValueError(f"{str(weights_file)!r} is not a Medusa checkpoint (expected medusa_head.K.J.* tensors)")
    num_heads = int(config.get("medusa_num_heads", 1 + max(int(m[1]) for m in indices)))
    num_layers = int(config.get("medusa_num_layers",
                                1 + max((int(m[2]) for m in indices if m[3] != "weight"), default=-1)))
    shared = bool(config.get("share_lm_head", not any(m[3] == "weight" for m in indices)))
    reads_token = bool(config.get("reads_token", any(m[3] == "token_linear.weight" for m in indices)))
    for key, want in (("hidden_size", hidden_size), ("vocab_size", vocab_size)):
        if key in config and int(config[key]) != want:
            raise ValueError(f"Medusa checkpoint {str(path)!r} has {key} {config[key]}, the target {want}")
    draft_vocab_size = len(tensors["d2t"]) if "d2t" in tensors else vocab_size
    if reads_token and embedding is None:
        raise ValueError(f"Medusa checkpoint {str(path)!r} reads the root token: it needs the target's embedding")
    heads = MedusaHeads(hidden_size, vocab_size, num_heads, num_layers, lm_head if shared else None,
                        draft_vocab_size, reads_token, embedding)
    state = from_public_names(tensors, num_layers)
    expected = heads.state_dict()
    if "d2t" not in state:
        expected.pop("d2t")  # the whole target vocabulary: d2t = 0
    for name, tensor in state.items():
        if name not in expected:
            raise ValueError(f"Medusa checkpoint {str(path)!r}: {name!r} is beyond {num_heads} heads")
        if tuple(tensor.shape) != tuple(expected[name].shape):
            raise ValueError(f"Medusa checkpoint {str(path)!r}: {name!r} has shape {tuple(tensor.shape)}, the "
                             f"target needs {tuple(expected[name].shape)}")
    missing = sorted(set(expected) - set(state))
    if missing:
        raise ValueError(f"Medusa checkpoint {str(path)!r} lacks {', '.join(missing[:4])}"
                         + (" ..." if len(missing) > 4 else ""))
    heads.load_state_dict(state, strict=False)  # strict about names above; d2t may be absent
    return heads


# ---- the tree ----------------------------------------------------------------------------------

DEFAULT_RANK_SUM = 8  # the default tree's: 714 nodes for 4 heads


def default_choices(num_heads: int, max_rank_sum: int = DEFAULT_RANK_SUM) -> list[Choice]:
    """Every path of at most num_heads ranks whose ranks sum to at most max_rank_sum: the
    best candidates of every head, and lower-ranked ones where few others are taken (for 4
    heads, 2: 3 + 6 + 10 + 15 = 34 nodes; 8: 9 + 45 + 165 + 495 = 714). These are the
    candidates the proposer chooses its best nodes from each step; verified are only those
    (16 by default), so a large tree costs the proposal a little, not the verify. On the
    held-out prompts, heads reading the root token, 16 nodes kept, acceptance per step was
    1.74 from 34 candidates, 1.85 from 125 (sum 4), 1.89 from 714 and 1.90 from 1,364
    (sum 10): when head 0 is unsure, the right token is often ranked 4th to 9th."""
    choices = []
    for depth in range(1, num_heads + 1):
        for path in itertools.product(range(max_rank_sum + 1), repeat=depth):
            if sum(path) <= max_rank_sum:
                choices.append(path)
    return choices


def load_choices(path: str | Path) -> list[Choice]:
    """A JSON list of paths, e.g. [[0], [0, 0], [1], [0, 1]]."""
    try:
        raw = json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ValueError(f"cannot read the Medusa tree {str(path)!r}: {exc}") from exc
    if not isinstance(raw, list) or not all(isinstance(c, list) and all(isinstance(i, int) for i in c) for c in raw):
        raise ValueError(f"the Medusa tree {str(path)!r} must be a JSON list of lists of ints")
    return [tuple(c) for c in raw]


class CompiledTree:
    """A choices list as nodes in (depth, path) order: parents [n] (-1 = the root),
    depths [n] (1 = below the root) and ranks [n] (the node's rank in its head's top-k)."""

    def __init__(self, choices: list[Choice]):
        paths = sorted(set(tuple(c) for c in choices), key=lambda c: (len(c), c))
        if len(paths) != len(choices):
            raise ValueError("the Medusa tree lists a path twice")
        index = {path: i for i, path in enumerate(paths)}
        self.paths = paths
        self.parents, self.depths, self.ranks = [], [], []
        for path in paths:
            if not path or min(path) < 0:
                raise ValueError(f"Medusa tree path {list(path)} must be non-empty ranks >= 0")
            parent = path[:-1]
            if parent and parent not in index:
                raise ValueError(f"Medusa tree path {list(path)} has no parent path {list(parent)}")
            self.parents.append(index[parent] if parent else -1)
            self.depths.append(len(path))
            self.ranks.append(path[-1])
        self.max_depth = max(self.depths, default=0)
        self.top_k = 1 + max(self.ranks, default=0)

    def __len__(self) -> int:
        return len(self.paths)

    def candidates(self, probs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The tree's nodes for a batch of the heads' distributions, probs [B, D, V] (D >=
        max_depth): (draft ids [B, n], path values [B, n]: the product of the heads'
        probabilities from the root down to each node). Nodes ranked beyond a vocabulary
        smaller than the tree (a small draft vocabulary) get value 0 and id 0: leave them
        out with path_max_ranks() < V."""
        k = min(self.top_k, probs.shape[-1])
        values, indices = probs[:, :self.max_depth].topk(k, dim=-1)  # [B, D, k] each
        if k < self.top_k:
            values = nn.functional.pad(values, (0, self.top_k - k))
            indices = nn.functional.pad(indices, (0, self.top_k - k))
        depth_index, rank_index = torch.tensor(self.depths) - 1, torch.tensor(self.ranks)  # [n] each
        node_probs = values[:, depth_index, rank_index]  # [B, n]
        values = node_probs.clone()
        parents = torch.tensor(self.parents)  # [n]
        for depth in range(2, self.max_depth + 1):  # a depth's parents are all one level up, done already
            at = (depth_index == depth - 1).nonzero().squeeze(1)  # [m] this depth's nodes
            values[:, at] *= values[:, parents[at]]
        return indices[:, depth_index, rank_index], values

    def path_max_ranks(self) -> torch.Tensor:
        """Each node's highest rank along its path [n]: the node fits a tree width w when < w."""
        highest = list(self.ranks)
        for i, parent in enumerate(self.parents):  # parents first
            if parent >= 0:
                highest[i] = max(highest[i], highest[parent])
        return torch.tensor(highest)


# ---- the proposer ------------------------------------------------------------------------------

class MedusaProposer(Proposer):
    name = "medusa"
    needs_hidden_states = True

    def __init__(self, heads: MedusaHeads, tree: CompiledTree, device: torch.device):
        if tree.max_depth > heads.num_heads:
            raise ValueError(f"the Medusa tree is {tree.max_depth} deep but there are {heads.num_heads} heads")
        self.heads = heads.eval()
        self.tree = tree
        self.device = device
        self.dtype = next(heads.parameters()).dtype
        self.path_max_ranks = tree.path_max_ranks()  # [n]
        self.parents = torch.tensor(tree.parents)  # [n]

    @torch.inference_mode()
    def propose(self, requests: list[ProposalRequest]) -> list[DraftTree]:
        rows = [i for i, r in enumerate(requests) if r.last_hidden is not None]
        trees = [_EMPTY] * len(requests)
        if not rows:
            return trees
        tree = self.tree
        hidden = torch.stack([requests[i].last_hidden for i in rows]).to(self.device, self.dtype)  # [B, H]
        roots = torch.tensor([requests[i].token_ids[-1] for i in rows], device=self.device)  # [B] the tree's root
        logits = self.heads(hidden, roots)[:, :tree.max_depth]  # [B, D, Vd]
        draft_ids, values = tree.candidates(logits.softmax(dim=-1))  # [B, n] each
        node_tokens, values = self.heads.target_ids(draft_ids).cpu(), values.float().cpu()  # [B, n] each
        widths = torch.tensor([min(requests[i].tree_width, logits.shape[-1]) for i in rows])  # [B] within Vd
        allowed = self.path_max_ranks[None, :] < widths[:, None]  # [B, n]
        # best first; a child's value is at most its parent's, and ties keep (depth, path) order,
        # so parents come first and the first m nodes are the best m-node tree
        order = torch.sort(values.masked_fill(~allowed, -1.0), dim=1, descending=True, stable=True).indices
        counts = allowed.sum(dim=1)  # [B]
        for b, i in enumerate(rows):
            trees[i] = self._tree_of(order[b, :min(requests[i].max_nodes, int(counts[b]))], node_tokens[b])
        return trees

    def _tree_of(self, keep: torch.Tensor, tokens: torch.Tensor) -> DraftTree:
        """The draft tree of the candidate nodes keep [m] (parents before children)."""
        new_index = torch.full((len(self.tree) + 1,), -1, dtype=torch.long)  # [n + 1]: slot -1 = the root
        new_index[keep] = torch.arange(len(keep))
        return DraftTree(tokens[keep].tolist(), new_index[self.parents[keep]].tolist())


_EMPTY = DraftTree([], [])


def build_medusa_proposer(config, target) -> MedusaProposer:
    """Heads from config.medusa_heads, placed where config.draft_device says (the target's
    LM head copied there when shared), with the tree of config.medusa_tree or the default."""
    if not config.medusa_heads:
        raise ValueError("speculator 'medusa' needs trained heads: --medusa-heads DIR (see scripts/train_medusa.py)")
    model = target.model
    device = config.resolved_draft_device(target.device)
    dtype = getattr(torch, config.resolved_draft_dtype(device, target.device, target.dtype))
    lm_head = frozen_on(model.lm_head, device, dtype)
    heads = load_heads(config.medusa_heads, model.config.hidden_size, model.config.vocab_size, lm_head,
                       model.embed_tokens)
    heads.to(device=device, dtype=dtype)
    if heads.reads_token:
        heads.set_embedding(frozen_on(model.embed_tokens, device, dtype))
    choices = load_choices(config.medusa_tree) if config.medusa_tree else default_choices(heads.num_heads)
    tree = CompiledTree(choices)
    log.info("Medusa: %d heads (%d residual block(s) each, %s LM head%s) on %s in %s; tree of %d nodes, %d deep",
             heads.num_heads, heads.num_layers, "shared" if heads.shares_lm_head else "own",
             ", reading the root token" if heads.reads_token else "", device,
             str(dtype).replace("torch.", ""), len(tree), tree.max_depth)
    return MedusaProposer(heads, tree, device)


SPECULATOR = Speculator(
    "medusa", build_medusa_proposer, num_speculative_tokens=16, tree_width=9,  # width: its default tree's
    settings=(Setting("medusa_heads", None, "speculator medusa: trained heads (a directory or .safetensors file in "
                      "the public Medusa layout; python -m scripts.train_medusa makes them); they run where "
                      "--draft-device says"),
              Setting("medusa_tree", None, "speculator medusa: the candidate tree, a JSON list of top-k rank paths "
                      "such as [[0], [0, 0], [1]] (default: every path whose ranks sum to at most "
                      f"{DEFAULT_RANK_SUM})"),
              *DRAFT_PLACEMENT),
    requires=lambda config: None if config.medusa_heads else (
        "trained heads: --medusa-heads DIR (or medusa_heads=...; python -m scripts.train_medusa trains them)"),
    loads_weights=True)
