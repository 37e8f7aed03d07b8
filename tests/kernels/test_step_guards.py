"""The compiled decode step's guards (target_gpu.step_guards): the model's structure key
stands in for Dynamo's thousands of guards on the model. Models that differ in anything a
graph could depend on get different keys, and so graphs of their own; models that differ
only in their weights' values share a key; the compiled step keeps Dynamo's guards on its
other arguments and drops those on the model."""
from __future__ import annotations

import pytest
import torch
from torch import nn

from runtime.models.config import ModelConfig
from runtime.models.decoder import DecoderModel, RMSNorm
from target_gpu.step_guards import drop_model_guards, is_model_guard, structure_key


def tiny(**overrides) -> DecoderModel:
    config = dict(architecture="llama", vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=2,
                  num_heads=4, num_kv_heads=2, head_dim=8)
    return DecoderModel(ModelConfig(**{**config, **overrides})).eval().requires_grad_(False)


def test_models_that_differ_only_in_weight_values_share_a_key():
    a, b = tiny(), tiny()
    b.layers[0].mlp.down_proj.weight.normal_()
    b.norm.weight.fill_(2.0)
    assert not torch.equal(a.layers[0].mlp.down_proj.weight, b.layers[0].mlp.down_proj.weight)
    assert structure_key(a) == structure_key(b)


def test_opaque_objects_count_by_identity():
    """An object with no attributes to compare (a C++ handle, such as a process group)
    could be baked into a graph: two of them make two keys."""
    a, b = tiny(), tiny()
    a.handle, b.handle = object(), object()
    assert structure_key(a) != structure_key(b)
    b.handle = a.handle
    assert structure_key(a) == structure_key(b)


class OtherNorm(RMSNorm):
    pass


def tied(model: DecoderModel) -> DecoderModel:
    model.lm_head.weight = model.embed_tokens.weight
    return model


def column_major_head(model: DecoderModel) -> DecoderModel:
    weight = model.lm_head.weight  # [V, H]: the same shape and values, other strides
    model.lm_head.weight = nn.Parameter(weight.t().contiguous().t(), requires_grad=False)
    return model


def with_norm(model: DecoderModel, norm: nn.Module) -> DecoderModel:
    model.norm = norm
    return model


def hooked(model: DecoderModel) -> DecoderModel:
    model.layers[1].register_forward_hook(lambda *args: None)
    return model


CHANGES = {
    "a float the graph bakes in": lambda: tiny(rms_norm_eps=1e-3),
    "a config field": lambda: tiny(sliding_window=16),
    "a weight's shape": lambda: tiny(intermediate_size=96),
    "the dtype": lambda: tiny().to(torch.bfloat16),
    "tied weights": lambda: tied(tiny()),
    "a weight's strides": lambda: column_major_head(tiny()),
    "a module's class": lambda: with_norm(tiny(), OtherNorm(32, 1e-5)),
    "a hook": lambda: hooked(tiny()),
    "a requires_grad flag": lambda: tiny().requires_grad_(True),
}


@pytest.mark.parametrize("change", CHANGES)
def test_a_change_a_graph_could_depend_on_changes_the_key(change):
    assert structure_key(CHANGES[change]()) != structure_key(tiny())


def test_the_guard_filter_drops_the_models_guards_and_keeps_the_rest(engine_f32, tmp_path):
    """A step compiled with a recording filter, on a model of a fresh structure (so Dynamo
    traces it here): every guard on the model is dropped, the structure key's guard and
    those on the token tensors and caches are kept."""
    from runtime.engine import LLMEngine
    from target_gpu.compiled_decode import CompiledDecodeStep, decode_step
    from tests.helpers import save_tiny_model
    save_tiny_model("llama3", tmp_path, engine_f32.tokenizer, rms_norm_eps=4.56e-5)
    engine = LLMEngine(model=str(tmp_path), dtype="float32", device="cpu", kv_cache_memory="16MiB",
                       enforce_eager=True)
    seen: list[tuple[str, bool]] = []

    def recording(entries):
        keep = drop_model_guards(entries)
        seen.extend(zip((e.name for e in entries), keep))
        return keep

    step = CompiledDecodeStep(engine.runner.model, engine.runner.kv_cache)
    step.step = torch.compile(decode_step, dynamic=True, fullgraph=True, options={"guard_filter_fn": recording})
    step.warm_up(engine.runner.kv_cache.num_blocks - 1, torch.device("cpu"))
    kept = {name for name, keep in seen if keep}
    dropped = [name for name, keep in seen if not keep]
    assert {"structure", "input_ids", "visible"} <= kept
    assert any(name.startswith("k_caches") for name in kept)
    assert len(dropped) > 5 * len(kept) and all(is_model_guard(name) for name in dropped)
    assert not any(is_model_guard(name) for name in kept)
