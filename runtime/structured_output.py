"""Structured output: a request's output held to a JSON schema, any JSON, a regex, a list
of choices or an EBNF grammar, through xgrammar (Dong et al. 2024), with speculation kept
lossless.

- `GuidedSpec` (runtime.sampling_params) is what a request asks for (SamplingParams.guided).
- `Grammars` (one per engine) compiles specs for the engine's tokenizer, cached by
  xgrammar; a spec that does not compile, or whose first mask allows no token (a regex of
  characters the vocabulary cannot spell), is a ValueError naming the problem (a 400). The
  server compiles a request's spec off the engine's loop.
- `Constraint` (one per sequence) is the grammar's state after the sequence's committed
  output. Before a step is scheduled it prunes the draft nodes the grammar forbids after
  their path, with their subtrees (they cost no target work, and are counted), then
  extends the draft with what the grammar forces after each path (jump-forward decoding as
  drafting: the forced text in the tokenizer's own tokens, which the target's masked law
  accepts for sure where it is one-hot, and verifies as any draft where the grammar allows
  another split of the same text); at verification it gives the allowed tokens at the root
  and at every node, advancing the state along each node's path and rolling it back; after
  the step it advances by the committed tokens. Once the grammar is complete and has taken
  its stop token, the sequence is done ("stop").
- `StepMasks` fills every constrained sequence's masks for a step's logits rows [R, V] (on
  the grammar thread while a GPU target's pass runs), then applies them (xgrammar's
  kernel, on the logits' device) before greedy picks, rejection sampling and logprobs read
  them. The sampler then works on the masked, renormalised target distribution at every
  node, and on each kept node's draft law masked the same way (the law it was drawn from,
  given that it was not pruned), so the output is exactly constrained sampling from the
  target, whatever the proposer drafted.

A request whose grammar is not complete within max_tokens ends with "length", as any
other request: its text is then a prefix of a valid output, never claimed complete.
"""
from __future__ import annotations

import json
import re
import threading
from concurrent.futures import Future, ThreadPoolExecutor

import numpy as np
import torch

from runtime.draft_tree import DraftTree
from runtime.sampling_params import GuidedSpec


class GrammarError(ValueError):
    """A JSON schema, regex, choice list or grammar that does not compile, or that no output
    of the model's vocabulary satisfies."""


_WHAT = {"json": "JSON schema", "json_object": "JSON grammar", "regex": "regex", "choice": "choice list",
         "grammar": "grammar"}  # a GuidedSpec kind, in messages


def _ebnf_string(text: str) -> str:
    """text as an EBNF string literal (JSON's escapes are the grammar's)."""
    return json.dumps(text, ensure_ascii=False)


def _has_first_token(compiled, vocab_size: int) -> bool:
    """Whether the grammar's first mask allows any token (its stop token too, where it takes
    an empty output). A regex of characters the vocabulary cannot spell allows none."""
    import xgrammar as xgr
    bitmask = xgr.allocate_token_bitmask(1, vocab_size)  # int32 [1, ceil(V / 32)]
    xgr.GrammarMatcher(compiled).fill_next_token_bitmask(bitmask, 0)
    return bool(bitmask.any())


def _library_message(error: Exception) -> str:
    """xgrammar's message without its timestamp and source position."""
    lines = [line for line in str(error).splitlines() if line.strip()]
    return re.sub(r"^\[[\d:]+\] \S+:\d+: ", "", lines[0] if lines else repr(error))


class Grammars:
    """Compiles GuidedSpecs for one tokenizer (xgrammar loads on first use), from any thread:
    the server compiles a request's spec before it reaches the engine's loop, where
    `constraint` then finds it in xgrammar's cache (a large schema stalls no step)."""

    def __init__(self, tokenizer, vocab_size: int, stop_token_ids: list[int]):
        self.tokenizer, self.vocab_size, self.stop_token_ids = tokenizer, vocab_size, list(stop_token_ids)
        self._compiler = None
        self._lock = threading.Lock()  # around building the compiler; xgrammar's cache is thread-safe

    @property
    def compiler(self):
        with self._lock:
            if self._compiler is None:
                import xgrammar as xgr
                info = xgr.TokenizerInfo.from_huggingface(self.tokenizer, vocab_size=self.vocab_size,
                                                          stop_token_ids=self.stop_token_ids)
                self._compiler = xgr.GrammarCompiler(info, max_threads=1)
            return self._compiler

    def compile(self, spec: GuidedSpec):
        """The xgrammar CompiledGrammar of spec; GrammarError naming what does not compile, or
        saying that no token of the vocabulary can begin an output it takes."""
        try:
            compiled = self._compile(spec)
        except (RuntimeError, ValueError) as e:
            raise GrammarError(f"the {_WHAT[spec.kind]} does not compile: {_library_message(e)}") from None
        if not _has_first_token(compiled, self.vocab_size):
            raise GrammarError(f"the {_WHAT[spec.kind]} takes no output this model can write: no token of its "
                               f"vocabulary can begin one")
        return compiled

    def _compile(self, spec: GuidedSpec):
        compiler = self.compiler
        if spec.kind == "json":
            schema = spec.value if isinstance(spec.value, str) else json.dumps(spec.value)
            json.loads(schema)  # text that is no JSON at all: said by json, not by xgrammar's internals
            return compiler.compile_json_schema(schema, any_whitespace=False)
        if spec.kind == "json_object":
            return compiler.compile_json_schema(json.dumps({"type": "object"}), any_whitespace=False)
        if spec.kind == "regex":
            return compiler.compile_regex(spec.value)
        if spec.kind == "choice":
            return compiler.compile_grammar("root ::= " + " | ".join(map(_ebnf_string, spec.value)))
        return compiler.compile_grammar(spec.value)

    def constraint(self, spec: GuidedSpec) -> Constraint:
        """A fresh state of spec, which compile() has checked (LLMEngine.check_params): xgrammar's
        cache holds it, and its first mask is not filled again."""
        import xgrammar as xgr
        return Constraint(xgr.GrammarMatcher(self._compile(spec)), self.vocab_size, self.encode)

    def encode(self, text: str) -> list[int]:
        """text in the tokenizer's own tokens (the split the model learned)."""
        return self.tokenizer.encode(text, add_special_tokens=False)


class Constraint:
    """One sequence's grammar state (the module docstring); not thread-safe, as sequences are
    not. encode (text -> token ids) drafts forced text; without it nothing is forced."""

    def __init__(self, matcher, vocab_size: int, encode=None):
        self.matcher, self.vocab_size, self.encode = matcher, vocab_size, encode

    @property
    def is_finished(self) -> bool:
        """The grammar is complete and took its stop token: nothing may follow."""
        return self.matcher.is_terminated()

    def fork(self) -> Constraint:
        """An independent copy of the state (xgrammar's fork)."""
        return Constraint(self.matcher.fork(), self.vocab_size, self.encode)

    def accept(self, token_id: int) -> bool:
        """Advance by a committed token; False, with the state unchanged, where the grammar
        has no place for it: the masks allowed no token at all (no token of the vocabulary
        continues the grammar), so the sampler's pick is not one the grammar takes."""
        return self.matcher.accept_token(token_id)

    def prune(self, tree: DraftTree) -> DraftTree:
        """tree without the nodes the grammar forbids after their path, nor their subtrees."""
        children, kept = tree.children(), []

        def walk(node: int) -> None:
            if self.matcher.is_terminated():  # the grammar is complete: nothing may follow
                return
            for child in children[node + 1]:
                if self.matcher.accept_token(tree.token_ids[child]):
                    kept.append(child)
                    walk(child)
                    self.matcher.rollback(1)
        walk(-1)
        if len(kept) == len(tree):
            return tree
        kept.sort()  # parents before children still
        index = {node: i for i, node in enumerate(kept)}
        probs = None if tree.draft_probs is None else tree.draft_probs[kept]
        return DraftTree([tree.token_ids[n] for n in kept], [index.get(tree.parents[n], -1) for n in kept], probs)

    def extend(self, tree: DraftTree, max_depth: int, max_new: int) -> DraftTree:
        """tree (pruned) with the tokens the grammar forces after each leaf, or after the
        root when it is empty: chains appended as its last nodes (tree.num_forced), no path
        deeper than max_depth, at most max_new in all; their draft law, where the tree has
        draft probabilities, is one-hot."""
        if self.encode is None or max_new <= 0:
            return tree
        children = tree.children()
        token_ids, parents = list(tree.token_ids), list(tree.parents)

        def walk(node: int, depth: int) -> None:
            if self.matcher.is_terminated():
                return
            kids = children[node + 1]
            if not kids:  # a leaf: its forced chain
                for token in self.forced_tokens(min(max_depth - depth, max_new - len(token_ids) + len(tree))):
                    token_ids.append(token)
                    parents.append(node)
                    node = len(token_ids) - 1
            for child in kids:
                if self.matcher.accept_token(tree.token_ids[child]):  # pruned trees: always
                    walk(child, depth + 1)
                    self.matcher.rollback(1)
        walk(-1, 0)
        num_new = len(token_ids) - len(tree)
        if not num_new:
            return tree
        probs = tree.draft_probs
        if probs is not None:
            one_hot = torch.zeros(num_new, probs.shape[1], dtype=probs.dtype, device=probs.device)  # [k, V]
            one_hot[torch.arange(num_new), torch.tensor(token_ids[len(tree):])] = 1.0
            probs = torch.cat([probs, one_hot])
        return DraftTree(token_ids, parents, probs, tree.num_forced + num_new)

    def forced_tokens(self, limit: int) -> list[int]:
        """Up to limit tokens of the text the grammar forces from here, in the tokenizer's
        split, as far as the grammar takes them; the state is left as it was."""
        text = self.matcher.find_jump_forward_string() if limit > 0 else ""
        taken: list[int] = []
        for token in self.encode(text)[:limit] if text else ():
            if not self.matcher.accept_token(token):
                break
            taken.append(token)
        if taken:
            self.matcher.rollback(len(taken))
        return taken

    def fill(self, bitmask: torch.Tensor, row: int, tree: DraftTree) -> list[int]:
        """The allowed tokens at the root (bitmask row `row`) and at node i (row + 1 + i),
        bitmask int32 [R, ceil(V / 32)] (xgrammar's layout); returns the rows filled. Rows
        after a node that completes the grammar stay as they are (what follows is dropped)."""
        children, filled = tree.children(), []

        def walk(node: int) -> None:
            if self.matcher.is_terminated():
                return
            self.matcher.fill_next_token_bitmask(bitmask, row + node + 1)
            filled.append(row + node + 1)
            for child in children[node + 1]:
                if self.matcher.accept_token(tree.token_ids[child]):  # pruned trees: always
                    walk(child)
                    self.matcher.rollback(1)
        walk(-1)
        return filled


def allowed_tokens(bitmask: torch.Tensor, rows: list[int], vocab_size: int) -> torch.Tensor:
    """bool [len(rows), vocab_size]: the tokens bitmask's rows allow; xgrammar's layout: bit
    j of int32 word w is token 32w + j (numpy's unpack, for the draft laws)."""
    words = bitmask[rows].numpy().view(np.uint8)  # little-endian: byte b holds tokens 8b .. 8b + 7
    bits = np.unpackbits(words, axis=-1, count=vocab_size, bitorder="little")  # [rows, V] of 0/1
    return torch.from_numpy(bits.view(np.bool_))


_filler: ThreadPoolExecutor | None = None  # the grammar thread: fills masks while the target runs


class StepMasks:
    """The grammar masks of one step's logits rows [R, V]: the root and every node of each
    constrained sequence (seqs[k]'s root row is row_starts[k], then one row per node of
    trees[k]). They are filled from forks of the sequences' matchers (a fork costs about
    2 µs, and leaves nothing shared), so that with `overlap` the filling runs on the
    grammar thread while the target's pass runs (the matcher's calls release the GIL), and
    `apply` only waits for it and writes the masks on the logits' device (xgrammar's own
    kernel for the device: about 2.5 µs a 49k-token row on a CPU)."""

    def __init__(self, seqs: list, trees: list[DraftTree], row_starts: list[int], num_rows: int,
                 overlap: bool = True):
        self.trees, self.row_starts = trees, row_starts
        self.constrained = [k for k, seq in enumerate(seqs) if seq.constraint is not None]
        self.jobs = [(seqs[k].constraint.fork(), trees[k], row_starts[k]) for k in self.constrained]
        self.bitmask: torch.Tensor | None = None  # int32 [R, ceil(V / 32)]
        self.rows: list[int] = []  # the rows filled
        self.pending: Future | None = None
        if self.jobs:
            import xgrammar as xgr
            self.bitmask = xgr.allocate_token_bitmask(num_rows, self.jobs[0][0].vocab_size)  # all allowed
            if overlap:
                global _filler
                _filler = _filler or ThreadPoolExecutor(1, thread_name_prefix="grammar-masks")
                self.pending = _filler.submit(self._fill)
            else:
                self._fill()

    @classmethod
    def of(cls, layout, device: torch.device) -> StepMasks:
        """The masks of a runtime.verify_layout.VerifyLayout's sampling sequences, for a
        target on device. They overlap a CUDA target's pass, where the CPU waits meanwhile;
        a CPU target's pass uses every core, and a thread there cost 4-6% of decode speed
        on 2 cores (measured), so they are filled inline."""
        trees = layout.sampled_trees
        return cls(layout.sampled_seqs, trees, layout.logit_starts, sum(1 + len(t) for t in trees),
                   overlap=device.type == "cuda")

    def _fill(self) -> None:
        for constraint, tree, row in self.jobs:
            self.rows += constraint.fill(self.bitmask, row, tree)

    @torch.inference_mode()  # the target's logits are inference tensors
    def apply(self, logits: torch.Tensor) -> list[DraftTree]:
        """Mask logits [R, V] in place (forbidden tokens -inf) and return the trees to
        verify: a constrained one's draft probabilities kept to what the grammar allows at
        each node's parent, renormalised. That is the law a node that survived pruning was
        drawn from; verifying it against the unmasked law would bias the output (a pruned
        node is a rejection whose residual update would be skipped)."""
        if self.pending is not None:
            self.pending.result()
        if not self.rows:
            return self.trees
        import xgrammar as xgr
        xgr.apply_token_bitmask_inplace(logits, self.bitmask.to(logits.device, non_blocking=True), indices=self.rows)
        trees = list(self.trees)
        for k in self.constrained:
            tree, root = trees[k], self.row_starts[k]
            if tree.draft_probs is None or not len(tree):
                continue
            allowed = allowed_tokens(self.bitmask, list(range(root, root + 1 + len(tree))), tree.draft_probs.shape[1])
            q = tree.draft_probs * allowed[torch.tensor(tree.parents) + 1].to(tree.draft_probs.device)  # [n, V]
            trees[k] = DraftTree(tree.token_ids, tree.parents, q / q.sum(-1, keepdim=True).clamp_min(1e-30),
                                 tree.num_forced)
        return trees

