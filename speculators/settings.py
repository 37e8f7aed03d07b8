"""Settings blocks that several speculators share (each speculator's own block is in its
file): prompt lookup (ngram, lookahead) and where a draft model or head runs (draft,
medusa, eagle). The registry (speculators.registry) turns them into EngineConfig fields
and flags."""
from __future__ import annotations

from runtime.models.loader import QUANTIZATIONS
from speculators.registry import Setting

DTYPES = ("auto", "float32", "bfloat16", "float16")

PROMPT_LOOKUP = (
    Setting("prompt_lookup_min", 1, "ngram/lookahead: shortest suffix to match", int, minimum=1),
    Setting("prompt_lookup_max", 4, "ngram/lookahead: longest suffix to match", int, minimum=1),
)


def check_prompt_lookup(config) -> None:
    if config.prompt_lookup_min > config.prompt_lookup_max:
        raise ValueError(f"need 1 <= prompt_lookup_min <= prompt_lookup_max, got {config.prompt_lookup_min} "
                         f"and {config.prompt_lookup_max}")


def _check_draft_device(value: str) -> None:
    if value not in ("auto", "cpu", "cuda") and not value.startswith("cuda:"):
        raise ValueError(f"draft_device must be auto, cpu, cuda or cuda:N, got {value!r}")


DRAFT_PLACEMENT = (
    Setting("draft_device", "auto", "where the draft model (or the Medusa or EAGLE heads) runs: auto = the CPU, "
            "unless the target is on a GPU and fewer than 4 cores are available", validate=_check_draft_device),
    Setting("draft_dtype", "auto", "draft model dtype: auto = the target's on the same device, else bfloat16 on "
            "GPUs and CPUs with bf16 math (AMX, AVX-512 BF16), float32 otherwise", choices=DTYPES),
    Setting("draft_backend", "auto", "CPU draft backend: auto = ipex when intel-extension-for-pytorch imports",
            choices=("auto", "ipex", "torch")),
    Setting("draft_quantization", "auto", "weight-only quantization of the draft model, as --quantization; int8 "
            "also quantizes a float draft (or heads), int4 quantizes whatever is left float",
            choices=QUANTIZATIONS),
)
