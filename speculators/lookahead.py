"""The Lookahead Cache (TACO-LLM; Zhao et al. 2024, "Lookahead"): drafts from a trie of
the n-grams a request has already seen, so text that repeats its input (code edits, RAG
answers, summaries, JSON) gets long drafts for free on the CPU.

Each request has a trie over its prompt and committed output: every window of `window`
tokens starting at each position is inserted, and each node counts how many windows
pass through it, i.e. how often that n-gram occurred. Inserting is incremental: the
request keeps one cursor per still-open window, and each new token advances them all
(O(window) per token).

To propose, the longest suffix of the sequence (at most `max_match` tokens, at least
`min_match`) that occurred before with a continuation is looked up; the subtree below it
holds the continuations with their frequencies.
  - chain (tree_width 1): follow the most frequent child, up to the node budget;
  - tree (tree_width > 1): best-first expansion by estimated path probability (product
    of child count / sibling total), at most tree_width children a node, pruned to the
    node budget. Likelier siblings come first, as the rejection sampler wants.

An optional global trie, shared by all requests, receives the same windows; it has a
node cap and evicts least-recently-used first-token subtrees beyond it (inserting under
or matching a first token is a use; the subtree being written is never evicted, so one
very frequent first token can hold the trie above the cap until the next token). A request uses
whichever trie matches the longer suffix (its own on ties).
"""
from __future__ import annotations

import heapq
from collections import OrderedDict
from dataclasses import dataclass, field

from speculators.base import Proposer, ProposalRequest
from runtime.draft_tree import DraftTree
from speculators.registry import Setting, Speculator
from speculators.settings import PROMPT_LOOKUP


class _Node:
    __slots__ = ("count", "children", "size")

    def __init__(self) -> None:
        self.count = 0
        self.children: dict[int, _Node] | None = None
        self.size = 1  # nodes in this subtree; kept up to date on first-level nodes only


@dataclass(slots=True)
class _Cursor:
    """An open window: the node it has reached, its depth, and its first-level node."""

    node: _Node
    depth: int
    top: _Node


class NGramTrie:
    def __init__(self, window: int, max_nodes: int | None = None):
        if window < 2:
            raise ValueError(f"the trie window must be >= 2 tokens, got {window}")
        self.window = window
        self.max_nodes = max_nodes
        self.root_children: OrderedDict[int, _Node] = OrderedDict()  # in least-recently-used order
        self.num_nodes = 0

    def push(self, cursors: list[_Cursor], token: int) -> list[_Cursor]:
        """Add `token` to every open window of one token stream and open a new one there."""
        top = self.root_children.get(token)
        if top is None:
            top = self.root_children[token] = _Node()
            self.num_nodes += 1
        else:
            self.root_children.move_to_end(token)
        top.count += 1
        advanced = [_Cursor(top, 1, top)]
        for cursor in cursors:
            if cursor.top.size == 0:  # its subtree was evicted
                continue
            children = cursor.node.children
            if children is None:
                children = cursor.node.children = {}
            child = children.get(token)
            if child is None:
                child = children[token] = _Node()
                cursor.top.size += 1
                self.num_nodes += 1
            child.count += 1
            if cursor.depth + 1 < self.window:
                advanced.append(_Cursor(child, cursor.depth + 1, cursor.top))
        self._evict()
        return [c for c in advanced if c.top.size > 0]

    def _evict(self) -> None:
        if self.max_nodes is None:
            return
        while self.num_nodes > self.max_nodes and len(self.root_children) > 1:
            _, top = self.root_children.popitem(last=False)
            self.num_nodes -= top.size
            top.size = 0  # marks it detached: cursors inside it are dropped

    def match(self, token_ids: list[int], min_match: int, max_match: int) -> tuple[_Node | None, int]:
        """The node of the longest suffix of token_ids (min_match..max_match tokens) that has
        continuations, and its length; (None, 0) when there is none."""
        for m in range(min(max_match, len(token_ids)), min_match - 1, -1):
            node = self._walk(token_ids[-m:])
            if node is not None and node.children:
                self.root_children.move_to_end(token_ids[-m])  # a hit is a use
                return node, m
        return None, 0

    def _walk(self, tokens: list[int]) -> _Node | None:
        node = self.root_children.get(tokens[0])
        if node is None:
            return None
        for token in tokens[1:]:
            if not node.children:
                return None
            node = node.children.get(token)
            if node is None:
                return None
        return node


def continuation_tree(node: _Node, max_nodes: int, tree_width: int, max_depth: int) -> DraftTree:
    """Best-first: the max_nodes likeliest continuations below `node`, parents first."""
    tokens: list[int] = []
    parents: list[int] = []
    order = 0  # tie-break so the heap never compares nodes
    heap: list[tuple[float, int, int, _Node, int, int]] = []  # (-prob, order, token, node, parent, depth)

    def push_children(parent_node: _Node, prob: float, parent_index: int, depth: int) -> None:
        nonlocal order
        if depth > max_depth or not parent_node.children:
            return
        total = sum(child.count for child in parent_node.children.values())
        best = heapq.nlargest(tree_width, parent_node.children.items(), key=lambda kv: kv[1].count)
        for token, child in best:
            heapq.heappush(heap, (-prob * child.count / total, order, token, child, parent_index, depth))
            order += 1

    push_children(node, 1.0, -1, 1)
    while heap and len(tokens) < max_nodes:
        neg_prob, _, token, child, parent_index, depth = heapq.heappop(heap)
        tokens.append(token)
        parents.append(parent_index)
        push_children(child, -neg_prob, len(tokens) - 1, depth + 1)
    return DraftTree(tokens, parents)


@dataclass(slots=True)
class _RequestState:
    trie: NGramTrie
    cursors: list[_Cursor] = field(default_factory=list)
    global_cursors: list[_Cursor] = field(default_factory=list)
    num_indexed: int = 0


class LookaheadProposer(Proposer):
    name = "lookahead"

    def __init__(self, max_depth: int = 8, min_match: int = 1, max_match: int = 4, global_max_nodes: int = 0):
        if not 1 <= min_match <= max_match:
            raise ValueError(f"need 1 <= min_match <= max_match, got {min_match} and {max_match}")
        if max_depth < 1:
            raise ValueError(f"max_depth must be >= 1, got {max_depth}")
        self.max_depth = max_depth
        self.min_match = min_match
        self.max_match = max_match
        self.window = max_match + max_depth
        self.global_trie = NGramTrie(self.window, global_max_nodes) if global_max_nodes > 0 else None
        self.requests: dict[str, _RequestState] = {}

    def propose(self, requests: list[ProposalRequest]) -> list[DraftTree]:
        return [self._propose_one(r) for r in requests]

    def _propose_one(self, request: ProposalRequest) -> DraftTree:
        state = self._sync(request.request_id, request.token_ids)
        node, length = state.trie.match(request.token_ids, self.min_match, self.max_match)
        if self.global_trie is not None:
            global_node, global_length = self.global_trie.match(request.token_ids, self.min_match, self.max_match)
            if global_length > length:
                node = global_node
        if node is None:
            return DraftTree([], [])
        return continuation_tree(node, request.max_nodes, request.tree_width, self.max_depth)

    def on_accepted(self, request_id: str, token_ids: list[int], num_accepted: int) -> None:
        self._sync(request_id, token_ids)

    def release(self, request_id: str) -> None:
        self.requests.pop(request_id, None)

    def _sync(self, request_id: str, token_ids: list[int]) -> _RequestState:
        """Index the tokens of the request not yet in its tries."""
        state = self.requests.get(request_id)
        if state is None:
            state = self.requests[request_id] = _RequestState(NGramTrie(self.window))
        for token in token_ids[state.num_indexed:]:
            state.cursors = state.trie.push(state.cursors, token)
            if self.global_trie is not None:
                state.global_cursors = self.global_trie.push(state.global_cursors, token)
        state.num_indexed = len(token_ids)
        return state


def _build(config, target) -> LookaheadProposer:
    return LookaheadProposer(max_depth=max(config.speculative_tokens("lookahead"), 1),
                             min_match=config.prompt_lookup_min, max_match=config.prompt_lookup_max,
                             global_max_nodes=config.lookahead_global_nodes)


# extra nodes cost little to verify: on the input-grounded benchmark, trees of width 3 beat chains
SPECULATOR = Speculator("lookahead", _build, num_speculative_tokens=8, tree_width=3, settings=PROMPT_LOOKUP + (
    Setting("lookahead_global_nodes", 0, "lookahead: node cap of a trie shared by all requests (least recently "
            "used first out); 0 = off", int, minimum=0),))
