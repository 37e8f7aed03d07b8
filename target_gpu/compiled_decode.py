"""A decode or verify step (every sequence brings one new token, and maybe a draft tree
below it; every token wants logits) as one torch.compile'd graph: the whole decoder, its
paged attention and the LM head.

Eager PyTorch spends most of a small model's decode step dispatching small operators
(norms, rotary, residual adds, attention glue: about 70 per layer). Inductor fuses them into
a few C++ kernels per layer around the weight kernels (quant_linear's int4/int8 calls,
oneDNN's), so what is left is close to the time the weights take to stream from memory.
Prefill chunks run eagerly.

Each of the step's T tokens attends to the cache positions marked in its row of a [T, L]
mask, over its sequence's blocks gathered by block table (the new keys are written to
their slots first): its context, and itself and its tree ancestors (which sit in the
cache in the order the step brings them). So the step is described by five tensors whose
sizes are the only things that vary:
  input_ids, positions, slots [T]; tables [T, NB] (each token's sequence's block table);
  visible [T, L], L = NB * block_size.
T and NB are compiled dynamic (dynamic=True): one graph for one token and one for more
(Dynamo specialises sizes 0 and 1; NB is padded to at least 2 for that reason), both
compiled when the runner is built (warm_up), so no request waits on compilation. Each
token reads its sequence's keys on its own, so a verify step costs T gathers of the
context: the runner sends long-context trees the eager way (ModelRunner.execute).
"""
from __future__ import annotations

import functools
import threading
import time

import torch

from runtime.models.packed_linear import PackedLinear
from target_gpu.inductor_backports import define_each_cpp_kernel_once
from target_gpu.kv_cache import KVCache
from target_gpu.step_guards import drop_model_guards, structure_key


def paged_decode_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                           v_cache: torch.Tensor, slots: torch.Tensor, tables: torch.Tensor,
                           visible: torch.Tensor) -> torch.Tensor:
    """q [T, Hq, D], k, v [T, Hkv, D] (the step's new tokens) -> [T, Hq, D].
    k_cache, v_cache [num_blocks, block_size, Hkv, D]; slots [T]; tables [T, NB]: the block
    table of each token's sequence; visible [T, L] (bool, L = NB * block_size): the cache
    positions each token attends to (its context, and itself and its tree ancestors)."""
    t, num_heads, head_dim = q.shape
    num_kv_heads = k.shape[1]
    g = num_heads // num_kv_heads
    block_size = k_cache.shape[1]
    blocks, offsets = slots // block_size, slots % block_size  # [T]
    k_cache[blocks, offsets] = k  # an index_put_ on the cache itself, which Inductor does in place
    v_cache[blocks, offsets] = v
    keys = k_cache[tables].flatten(1, 2)[:, :, :, None, :].float()  # [T, L, Hkv, 1, D]
    values = v_cache[tables].flatten(1, 2)[:, :, :, None, :].float()
    queries = q.view(t, 1, num_kv_heads, g, head_dim).float()  # the G query heads of a KV head share its keys
    # products and sums rather than matmuls (or F.scaled_dot_product_attention): Inductor reads
    # the gathered keys and values in place, in the cache's layout, with no transposed copy (and
    # SDPA's CPU lowering specialised the graph on L: a recompile each time a sequence grew a block)
    scores = (queries * keys).sum(-1) * head_dim ** -0.5  # [T, L, Hkv, G]
    scores = scores.masked_fill(~visible[:, :, None, None], float("-inf"))
    out = (scores.softmax(1)[..., None] * values).sum(1)  # [T, Hkv, G, D]
    return out.to(q.dtype).reshape(t, num_heads, head_dim)


def decode_step(structure: str, model, k_caches: list[torch.Tensor], v_caches: list[torch.Tensor],
                feature_layers: frozenset[int], input_ids, positions, slots, tables,
                visible) -> tuple[torch.Tensor, torch.Tensor]:
    """One decode or verify step of `model` over per-layer KV caches; (logits [T, V], hidden [T, H']).
    structure: step_guards.structure_key(model), which the compiled step guards in place of the model."""
    if not structure:  # read, so that Dynamo guards its value
        raise ValueError("decode_step needs the model's structure key")

    def attention(layer_idx, q, k, v):
        return paged_decode_attention(q, k, v, k_caches[layer_idx], v_caches[layer_idx], slots, tables, visible)

    hidden = model(input_ids, positions, attention, feature_layers)  # [T, H']
    return model.compute_logits(hidden[:, :model.config.hidden_size]), hidden


@functools.cache
def compiled_decode_step(cpp_wrapper: bool):
    """decode_step compiled, one function for every engine in the process: the model and its
    caches are arguments, so a second engine on the same architecture reuses the first one's
    graphs. The feature layers are an argument too, a frozenset: Dynamo (torch 2.8, dynamic
    shapes) compiled `i in layers` over a tuple of ints as always false, and the step
    returned no features for EAGLE-3. cpp_wrapper: the graph's kernels are called from
    generated C++, not Python (a fifth of a small model's step was Python calling kernels); a
    model with oneDNN-prepacked weights (PackedLinear: opaque tensors, which the C++ wrapper
    cannot pass to an op) keeps the Python wrapper. The C++ wrapper is built apart from the
    kernels (cpp_wrapper_build_separate): the kernels at -O3, the wrapper, one long function
    of calls, at -O1: at -O3 that function was most of a first compile's g++ time, and
    -O1 runs the step as fast.
    The model's structure key stands in for Dynamo's guards on the model (step_guards).
    Made on first use: torch.compile imports Dynamo (and Triton, where installed)."""
    define_each_cpp_kernel_once()
    return torch.compile(decode_step, dynamic=True, fullgraph=True,
                         options={"cpp_wrapper": cpp_wrapper, "cpp_wrapper_build_separate": cpp_wrapper,
                                  "guard_filter_fn": drop_model_guards})


_configured = threading.local()


def configure_dynamo() -> None:
    """Dynamo's settings for the step, made in the calling thread: torch >= 2.12 keeps
    Dynamo's config per thread, and the step compiles on whichever thread first runs a shape
    (the draft worker has a thread of its own, the server's engine loop another).
    Dynamo keeps 8 graphs per function by default and, with fullgraph, then fails the step:
    one process may compile one per architecture, dtype, feature set and shape specialization
    (a target, its draft, EAGLE-3; the test session dozens), so the limit is raised to 64.
    Floats are specialized, as before torch 2.6: with dynamic shapes, Dynamo >= 2.6 makes
    every float module attribute (each RMSNorm's eps) a symbol, specializes them after the
    trace, and traces the whole decoder again (the default model's step compiled in 53 s
    with the compile caches warm, 18 s without the second trace; the same graph)."""
    if not getattr(_configured, "done", False):
        torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, 64)
        torch._dynamo.config.specialize_float = True
        _configured.done = True


class CompiledDecodeStep:
    """Runs a decode step's tokens through `model` compiled; returns logits [B, V] (float32)
    and the final hidden states [B, H'] (H' as DecoderModel.forward gives them)."""

    def __init__(self, model, kv_cache: KVCache, feature_layers: tuple[int, ...] = ()):
        self.model, self.kv_cache, self.feature_layers = model, kv_cache, feature_layers
        opaque = any(isinstance(m, PackedLinear) for m in model.modules())
        self.step = compiled_decode_step(cpp_wrapper=not opaque)
        self.structure = structure_key(model)
        self.layers = frozenset(feature_layers)  # (compiled_decode_step)
        for cache in (*kv_cache.k, *kv_cache.v):  # [num_blocks, block_size, Hkv, D]
            # all but num_blocks fixed: left dynamic, a dim equal to B or NB shares their symbol
            # (duck sizing) and pins it (Qwen2.5-0.5B's 2 KV heads recompiled at NB = 3)
            for dim in (1, 2, 3):
                torch._dynamo.mark_static(cache, dim)

    @torch.inference_mode()  # as ModelRunner.execute runs: the graphs guard on it
    def warm_up(self, scratch_block: int, device: torch.device) -> float:
        """Compile the graphs of one sequence and of several now, running dummy tokens whose
        KV goes to the scratch block; the seconds it took."""
        start = time.perf_counter()
        configure_dynamo()
        block_size = self.kv_cache.k[0].shape[1]
        for t in (1, 2):
            ids = torch.zeros(t, dtype=torch.long, device=device)
            slots = torch.full((t,), scratch_block * block_size, dtype=torch.long, device=device)
            tables = torch.full((t, 2), scratch_block, dtype=torch.long, device=device)  # [T, NB]
            visible = torch.zeros(t, 2 * block_size, dtype=torch.bool, device=device)  # [T, L]
            visible[:, 0] = True
            self.step(self.structure, self.model, self.kv_cache.k, self.kv_cache.v, self.layers, ids, ids.clone(),
                      slots, tables, visible)
        return time.perf_counter() - start

    def __call__(self, step, device: torch.device, block_size: int):
        """Run a prepared decode or verify step (ModelRunner.prepare's StepInput, every row
        wanting logits); returns (logits [T, V], hidden [T, H'])."""
        configure_dynamo()
        num_blocks = max(2, max(-(-a.seq_len // block_size) for a in step.attn_inputs))
        window = self.model.config.sliding_window
        tables, limits, trees = [], [], []  # limits [T]: the last cache position a token sees below its tree
        for a in step.attn_inputs:
            tables += [a.block_table[:num_blocks] + [0] * (num_blocks - len(a.block_table))] * a.query_len
            if a.mask is None:  # causal: each new token sees the ones before it and itself
                limits += range(a.seq_len - a.query_len, a.seq_len)
            else:  # a tree: the context, then the tree mask over the last keys
                context = a.seq_len - a.mask.shape[1]
                limits += [context - 1] * a.query_len
                trees.append((a, context))
        key = torch.arange(num_blocks * block_size)  # [L]
        visible = key[None, :] <= torch.tensor(limits)[:, None]  # [T, L]
        if window is not None:
            visible &= key[None, :] > torch.tensor(step.positions)[:, None] - window
        for a, context in trees:
            visible[a.query_start:a.query_start + a.query_len, context:a.seq_len] = a.mask
        ints = torch.tensor([step.input_ids, step.positions, step.slots], dtype=torch.long)  # [3, T]
        ids, positions, slots = (row.to(device) for row in ints.unbind(0))  # own storage each
        return self.step(self.structure, self.model, self.kv_cache.k, self.kv_cache.v, self.layers, ids.clone(),
                         positions.clone(), slots.clone(), torch.tensor(tables, dtype=torch.long, device=device),
                         visible.to(device))
