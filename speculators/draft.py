"""The draft-model proposer: a small model with the target's vocabulary drafts the tree.

Per step, for all its sequences at once (on the draft worker's thread, draft_cpu.worker):
  1. line each sequence's draft cache up with the committed tokens (rollback is free) and
     run what the draft has not seen yet: the last step's bonus or recovered token, and
     on the first step the prompt;
  2. walk down a main chain, one batched draft forward per depth: at depth j the draft's
     distribution q_j gives the chain's next token (greedy requests: the argmax;
     sampled requests: a draw from q_j after the request's temperature/top-k/top-p) and,
     when trees are on, up to width - 1 siblings (the next most likely tokens; sampled:
     further draws without replacement, each with its renormalised q as draft_probs);
  3. rank chain nodes and siblings by their path probability under the draft and keep
     the best max_nodes (parents always outrank their children, so the result is a tree).
The chain stops early when its path probability falls below `min_path_prob` or when it
could no longer make the cut: each depth costs a draft forward, so a draft that has lost
confidence stops spending time. Sampled requests carry draft_probs (lossless recursive
rejection sampling); greedy ones are verified by argmax and need none.

Drafting ahead (overlap): while the target verifies a step's trees, `draft_ahead` keeps
extending each main chain past its last node, one batched forward at a time, until the
engine says verification is done (PEARL's post-verify, Liu et al. 2024). When the
target accepts the whole chain and its bonus token is the draft's next token, those
tokens (with the distributions they were drawn from) are the next step's first chain
nodes, for free; otherwise the worker's next sync drops them. Sampled tokens drawn
ahead are still draws from q given their prefix, so acceptance stays lossless.
"""
from __future__ import annotations

import logging
import threading
from dataclasses import dataclass
from functools import partial

import torch

from runtime.sampling import target_probs
from runtime.sampling_params import SamplingParams
from speculators.base import ProposalRequest, Proposer
from runtime.draft_tree import DraftTree
from speculators.registry import Setting, Speculator
from speculators.settings import DRAFT_PLACEMENT

log = logging.getLogger("speculators.draft")


@dataclass(slots=True)
class _Node:
    value: float  # path probability under the draft (siblings capped by earlier siblings)
    depth: int
    token: int
    parent: int  # node index, -1 = the root
    q: torch.Tensor | None  # [V] the distribution the token was drawn from (sampled requests)


class _Drafting:
    """One sequence's draft in progress."""

    __slots__ = ("request", "seq", "nodes", "chain", "path_prob", "generator", "base")

    def __init__(self, request: ProposalRequest, seq, generator: torch.Generator | None):
        self.request = request
        self.seq = seq
        self.generator = generator
        self.base = len(request.token_ids)  # position of the chain's first token
        self.nodes: list[_Node] = []
        self.chain: list[int] = []  # node indices of the main chain
        self.path_prob = 1.0

    def parent(self) -> int:
        return self.chain[-1] if self.chain else -1

    def chain_tokens(self) -> list[int]:
        return [self.nodes[i].token for i in self.chain]


@dataclass(slots=True)
class _AheadState:
    """What drafting ahead needs of a request: how it samples, and the chain it verifies."""

    params: SamplingParams
    generator: torch.Generator | None
    max_tokens: int  # the most tokens worth drafting ahead (the next step's node budget)
    chain_depth: int  # depth of the main chain proposed last
    probs_at: dict[int, torch.Tensor]  # position -> the q its token ahead was drawn from


class DraftModelProposer(Proposer):
    name = "draft"

    def __init__(self, worker, target_vocab_size: int, min_path_prob: float = 0.2, seed: int | None = None,
                 overlap: bool = False):
        self.worker = worker
        self.vocab_size = target_vocab_size
        self.min_path_prob = min_path_prob
        self.overlap = overlap
        self.generator = torch.Generator()
        if seed is not None:
            self.generator.manual_seed(seed)
        else:
            self.generator.seed()
        self._generators: dict[str, torch.Generator] = {}  # per seeded request (its draft draws only)
        self._ahead: dict[str, _AheadState] = {}
        self.num_ahead_tokens = 0  # tokens drafted ahead during verification
        self.num_ahead_used = 0  # of those, tokens that became chain nodes of the next step

    def propose(self, requests: list[ProposalRequest]) -> list[DraftTree]:
        return self.worker.submit(self.draft, requests).result()

    def draft_ahead(self, verifying: list[tuple[str, DraftTree]]) -> threading.Event | None:
        if not self.overlap:
            return None
        ahead = [(rid, tree, self._ahead.get(rid)) for rid, tree in verifying]
        ids = [rid for rid, tree, a in ahead if a is not None and tree.max_depth >= a.chain_depth > 0]
        if not ids:
            return None
        done = threading.Event()
        self.worker.submit(self._draft_ahead, ids, done).add_done_callback(_log_failure)
        return done

    def busy_between(self, t0: float, t1: float) -> float:
        return self.worker.busy_between(t0, t1)

    def release(self, request_id: str) -> None:
        self._generators.pop(request_id, None)
        self.worker.submit(self._release, request_id)

    def close(self) -> None:
        self.worker.close()

    # ---- on the worker thread -----------------------------------------------------------
    def _release(self, request_id: str) -> None:
        self._ahead.pop(request_id, None)
        self.worker.release(request_id)

    def draft(self, requests: list[ProposalRequest]) -> list[DraftTree]:
        worker = self.worker
        states: list[_Drafting | None] = []
        for r in requests:
            seq = worker.sync(r.request_id, r.token_ids)
            state = _Drafting(r, seq, self._generator(r)) if worker.can_run(seq) else None
            if state is not None:
                self._use_head_start(state)
            states.append(state)
        active = [s for s in states if s is not None and s.request.max_nodes > len(s.chain)
                  and (not s.chain or self._should_deepen(s))]
        while active:
            for s in active:  # the chain's last token joins the sequence, unless drafted ahead already
                if s.chain and len(s.seq.token_ids) == s.base + len(s.chain) - 1:
                    s.seq.token_ids.append(s.nodes[s.chain[-1]].token)
            active = [s for s, fits in zip(active, worker.fitting([s.seq for s in active])) if fits]
            if not active:
                break
            logits = self._to_target_vocab(worker.forward([s.seq for s in active]))  # [B, V]
            probs = self._draft_probs(logits, [s.request.params for s in active])  # [B, V]
            for s, q in zip(active, probs):
                self._expand(s, q)
            active = [s for s in active if self._should_deepen(s)]
        for s in states:
            if s is not None:
                self._finish_chain(s)
        return [_EMPTY if s is None else self._tree(s) for s in states]

    def _use_head_start(self, state: _Drafting) -> None:
        """Turn the tokens drafted ahead (if any) into the first chain nodes."""
        seq, base = state.seq, state.base
        ahead = self._ahead.get(state.request.request_id)
        tail = seq.token_ids[base:]
        probs = [ahead.probs_at.get(base + i) for i in range(len(tail))] if ahead else [None] * len(tail)
        usable = next((i for i, q in enumerate(probs) if q is None), len(tail))
        if usable < len(tail):
            self.worker.truncate(seq, base + usable)
        for token, q in zip(tail[:usable], probs[:usable]):
            self._expand(state, q, token)
            self.num_ahead_used += 1
            if not self._should_deepen(state):
                break

    def _finish_chain(self, state: _Drafting) -> None:
        """The sequence ends with the whole main chain (ready to draft ahead from); what was
        drafted ahead past the chain is dropped."""
        seq, base, chain = state.seq, state.base, state.chain_tokens()
        if seq.token_ids[base:] != chain:
            self.worker.truncate(seq, base + min(len(chain), len(seq.token_ids) - base))
            seq.token_ids.extend(chain[len(seq.token_ids) - base:])
        request = state.request
        self._ahead[request.request_id] = _AheadState(request.params, state.generator, request.max_nodes,
                                                      len(chain), {})

    def _draft_ahead(self, request_ids: list[str], done: threading.Event) -> None:
        """Extend the verified chains until `done` is set (or a next step's worth)."""
        worker = self.worker
        items = [(worker.sequences[rid], self._ahead[rid]) for rid in request_ids
                 if rid in worker.sequences and rid in self._ahead]
        for _ in range(max((a.max_tokens for _, a in items), default=0)):
            items = [(seq, a) for seq, a in items if len(a.probs_at) < a.max_tokens]
            items = [item for item, fits in zip(items, worker.fitting([seq for seq, _ in items])) if fits]
            if done.is_set() or not items:
                return
            logits = self._to_target_vocab(worker.forward([seq for seq, _ in items]))  # [B, V]
            probs = self._draft_probs(logits, [a.params for _, a in items])  # [B, V]
            for (seq, a), q in zip(items, probs):
                token = (int(q.argmax()) if a.generator is None
                         else int(torch.multinomial(q, 1, generator=a.generator)))
                a.probs_at[len(seq.token_ids)] = q
                seq.token_ids.append(token)
                self.num_ahead_tokens += 1

    def _generator(self, request: ProposalRequest) -> torch.Generator | None:
        if request.params.is_greedy:
            return None
        if request.params.seed is None:
            return self.generator
        gen = self._generators.get(request.request_id)
        if gen is None:
            gen = self._generators[request.request_id] = torch.Generator()
            gen.manual_seed(request.params.seed + 0x5EED)
        return gen

    def _to_target_vocab(self, logits: torch.Tensor) -> torch.Tensor:
        """Draft logits [B, Vd] -> [B, V] in the target's vocabulary (same token ids; rows
        past the draft's table can never be drafted)."""
        logits = logits.float().cpu()
        vd = logits.shape[1]
        if vd >= self.vocab_size:
            return logits[:, :self.vocab_size]
        pad = torch.full((logits.shape[0], self.vocab_size - vd), float("-inf"))
        return torch.cat([logits, pad], dim=1)

    @staticmethod
    def _draft_probs(logits: torch.Tensor, params) -> torch.Tensor:
        """q per row: the request's sampling distribution, or the plain softmax for greedy
        requests (ranks and path probabilities only)."""
        greedy = torch.tensor([p.is_greedy for p in params])
        if bool(greedy.all()):
            return logits.softmax(dim=-1)
        sampled = target_probs(logits, params)
        return torch.where(greedy.unsqueeze(1), logits.softmax(dim=-1), sampled)

    def _expand(self, state: _Drafting, q: torch.Tensor, main_token: int | None = None) -> None:
        """Add depth len(chain) + 1 under the chain's last node: the main child (main_token
        when it was drawn already, ahead) and up to width - 1 siblings."""
        width = max(1, state.request.tree_width)
        rest = q
        tokens = []
        if main_token is not None:
            tokens.append(main_token)
            rest = q.clone()
            rest[main_token] = 0.0
        more = width - len(tokens)
        if more > 0 and state.generator is None:  # greedy: the most likely tokens, in order
            tokens += rest.topk(more).indices.tolist()
        elif more > 0:
            more = min(more, int((rest > 0).sum()))
            if more:
                tokens += torch.multinomial(rest, more, replacement=False, generator=state.generator).tolist()
        depth = len(state.chain) + 1
        parent = state.parent()
        residual = q
        cap = state.path_prob
        for i, token in enumerate(tokens):
            value = min(cap, state.path_prob * float(q[token]))  # siblings keep their draw order
            cap = value
            draft_q = None
            if state.generator is not None:  # the distribution this draw came from
                draft_q = residual
                residual = residual.clone()
                residual[token] = 0.0
                residual = residual / residual.sum().clamp_min(1e-30)
            state.nodes.append(_Node(value, depth, token, parent, draft_q))
            if i == 0:
                state.chain.append(len(state.nodes) - 1)
        state.path_prob = state.nodes[state.chain[-1]].value

    def _should_deepen(self, state: _Drafting) -> bool:
        """Whether the chain goes one deeper: budget left, confident enough, and a deeper
        node could still make the best max_nodes."""
        budget = state.request.max_nodes
        if len(state.chain) >= budget or state.path_prob < self.min_path_prob:
            return False
        return sum(1 for node in state.nodes if node.value > state.path_prob) < budget

    @staticmethod
    def _tree(state: _Drafting) -> DraftTree:
        """The best max_nodes nodes by path probability (parents first), as a DraftTree."""
        nodes = state.nodes
        order = sorted(range(len(nodes)), key=lambda i: (-nodes[i].value, nodes[i].depth, i))
        keep = order[:state.request.max_nodes]
        new_index = {old: new for new, old in enumerate(keep)}
        tokens, parents, rows = [], [], []
        for old in keep:
            node = nodes[old]
            tokens.append(node.token)
            parents.append(-1 if node.parent == -1 else new_index[node.parent])
            rows.append(node.q)
        probs = None if state.generator is None else torch.stack(rows)  # [n, V]
        return DraftTree(tokens, parents, probs)


def _log_failure(future) -> None:
    if not future.cancelled() and future.exception() is not None:
        log.error("drafting ahead failed; the next step drafts from scratch", exc_info=future.exception())


_EMPTY = DraftTree([], [])


def check_same_vocabulary(draft_tokenizer, target_tokenizer, draft_name: str) -> None:
    """ValueError unless both tokenizers map the same strings to the same ids."""
    draft_vocab, target_vocab = draft_tokenizer.get_vocab(), target_tokenizer.get_vocab()
    if draft_vocab == target_vocab:
        return
    differing = sum(1 for token, i in target_vocab.items() if draft_vocab.get(token) != i)
    raise ValueError(f"draft model {draft_name!r} does not share the target's vocabulary ({len(draft_vocab)} "
                     f"tokens against {len(target_vocab)}, {differing} of the target's tokens differ); a draft "
                     f"model must use the target's tokenizer")


def build_draft_proposer(config, target) -> DraftModelProposer:
    """Start a draft worker for config.draft_model where the config places it, check its
    vocabulary against the target's, and give the target the cores the draft does not use."""
    from draft_cpu.placement import default_draft_cores, fit_openmp_team, parse_core_list
    from draft_cpu.worker import DraftWorker, DraftWorkerConfig
    if not config.draft_model:
        raise ValueError("speculator 'draft' needs a draft model, and this engine was started without one "
                         "(--draft-model PATH)")
    device = config.resolved_draft_device(target.device)
    dtype = config.resolved_draft_dtype(device, target.device, target.dtype)
    cores = None
    if device.type == "cpu":
        cores = (parse_core_list(config.draft_cpu_cores) if config.draft_cpu_cores
                 else default_draft_cores(target.device))
    elif config.draft_cpu_cores:
        log.warning("--draft-cpu-cores is ignored: the draft model runs on %s", device)
    max_nodes = max(config.speculative_tokens("draft"), 1)
    num_kv_tokens = target.num_kv_tokens + target.max_num_seqs * (max_nodes + config.block_size)
    # sharing the target's cores (and not asked to overlap), the draft takes turns with it on
    # the engine's thread: one OpenMP team for both (draft_cpu.placement)
    shares_cores = device.type == "cpu" == target.device.type and cores is None
    own_thread = not shares_cores or config.draft_overlap == "on"
    worker = DraftWorker(DraftWorkerConfig(config.draft_model, str(device), dtype, config.draft_backend,
                                           config.draft_quantization, cores, num_kv_tokens,
                                           config.draft_kv_fraction(device, target.device), config.block_size,
                                           own_thread=own_thread, compile_decode=not config.enforce_eager))
    try:
        check_same_vocabulary(worker.tokenizer, target.tokenizer, config.draft_model)
    except ValueError:
        worker.close()
        raise
    if worker.target_cores is not None:  # this (the engine's) thread runs the target there
        worker.on_close(partial(torch.set_num_threads, torch.get_num_threads()))
        fit_openmp_team(len(worker.target_cores))
    # drafting ahead pays when draft and target do not compete for the same cores
    separate = device.type != target.device.type or worker.target_cores is not None
    overlap = config.draft_overlap == "on" or (config.draft_overlap == "auto" and separate)
    log.info("draft overlap with verification: %s", "on" if overlap else
             "off" + (" (draft and target share the CPU cores; --draft-cpu-cores splits them)"
                      if config.draft_overlap == "auto" else ""))
    return DraftModelProposer(worker, target.vocab_size, config.draft_min_path_prob, target.seed, overlap)


SPECULATOR = Speculator(
    "draft", build_draft_proposer, num_speculative_tokens=6, tree_width=2,
    settings=(Setting("draft_model", None, "speculator draft: the draft model (alias, .gguf file or HF directory) "
                      "with the target's vocabulary"),
              *DRAFT_PLACEMENT,
              Setting("draft_cpu_cores", None, "pin the CPU draft worker to these cores, e.g. 0-15 or 0-3,8-11; "
                      "the rest of the process moves off them (default: all but one core with a GPU target; "
                      "unpinned when the target is on the CPU)"),
              Setting("draft_min_path_prob", 0.2, "stop extending a draft chain when its probability under the "
                      "draft model falls below this", float, minimum=0.0, below=1.0),
              Setting("draft_overlap", "auto", "keep drafting while the target verifies: auto = on when the draft "
                      "has its own device or cores", choices=("auto", "on", "off"))),
    requires=lambda config: None if config.draft_model else "a draft model: --draft-model PATH (or draft_model=...)",
    loads_weights=True)
