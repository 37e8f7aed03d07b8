"""heterospec: a speculative decoding runtime (CPU drafts, GPU verifies, paged KV, continuous batching).

    from runtime import LLM, SamplingParams
    llm = LLM(model="smollm2-135m")
    print(llm.generate(["Hello"], SamplingParams(max_tokens=16))[0].text)
"""
from runtime.sampling_params import GuidedSpec, SamplingParams

__all__ = ["LLM", "SamplingParams", "GuidedSpec", "GenerationResult", "Completion"]


def __getattr__(name):  # keep `import runtime` light: torch/transformers load on first use
    if name in ("LLM", "GenerationResult", "Completion"):
        from runtime import llm
        return getattr(llm, name)
    raise AttributeError(name)
