"""Engine configuration, validated once at start."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from runtime.models.loader import DEFAULT_MODEL, QUANTIZATIONS
from runtime.sampling_params import SPECULATORS, check_speculator, speculator_parts

# Draft nodes per step when --num-speculative-tokens is not given, and tree width when
# --speculative-tree-width is not (lookahead: extra nodes cost little to verify, and on the
# input-grounded benchmark trees of width 3 beat chains, 2.65x against 1.99x plain decode).
DEFAULT_SPECULATIVE_TOKENS = {"ngram": 4, "lookahead": 8, "draft": 6, "medusa": 16, "eagle": 16}
DEFAULT_EAGLE_DEPTH = 5  # EAGLE-2: expansion steps, the deepest draft
DEFAULT_TREE_WIDTH = {"ngram": 1, "lookahead": 3, "draft": 2, "medusa": 9, "eagle": 4}  # medusa: its default tree's
DRAFT_DEVICES = ("auto", "cpu", "cuda")
ATTENTION_BACKENDS = ("auto", "torch", "triton")


def amx_available() -> bool:
    try:
        return bool(torch._C._cpu._is_amx_tile_supported())
    except AttributeError:
        return False


def cpu_has_bf16_math() -> bool:
    """Whether this CPU multiplies bf16 natively (AMX or AVX-512 BF16). Without either,
    oneDNN converts bf16 to fp32 on the fly: 5.5x slower than fp32 on an AVX2 EPYC here
    (256 x 576 @ 576 x 8192)."""
    if amx_available():
        return True
    try:
        cpuinfo = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    return any(line.startswith("flags") and "avx512_bf16" in line.split() for line in cpuinfo.splitlines())


@dataclass(slots=True)
class EngineConfig:
    model: str = DEFAULT_MODEL
    dtype: str = "auto"  # auto | float32 | bfloat16 | float16
    device: str = "auto"  # auto | cpu | cuda | cuda:N
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    max_model_len: int | None = None  # None: the model's context length (capped by the pool)
    block_size: int = 16
    enable_prefix_caching: bool = True  # reuse the KV of full blocks of committed tokens across requests
    kv_cache_memory: str | int | float | None = None  # bytes, "2GiB", or a fraction of free memory
    seed: int | None = None
    attention_backend: str = "auto"  # auto | torch | triton: auto is Triton on CUDA when it can run there, else torch
    enforce_eager: bool = False  # no CUDA graphs (GPU target), no compiled decode step (CPU target, CPU draft)
    cpu_weight_prepack: bool = True  # a bf16 target on the CPU: linear weights prepacked for oneDNN once
    quantization: str = "auto"  # auto | none | int8 | int4: the target's linear weights (runtime.models.loader)
    # speculation (a request may override speculator and num_speculative_tokens)
    speculator: str = "none"  # none | ngram | lookahead | draft | eagle | medusa
    num_speculative_tokens: int | None = None  # draft nodes verified per step; None: the speculator's default
    speculative_tree_width: int | None = None  # most children per draft node; 1 = chains; None: the speculator's default
    prompt_lookup_min: int = 1  # shortest suffix ngram/lookahead match on
    prompt_lookup_max: int = 4  # longest
    lookahead_global_nodes: int = 0  # node cap of the trie shared by all requests; 0 = off
    adaptive_speculation: bool = True  # size drafts per step from measured acceptance and costs
    # the draft model (speculator "draft"; draft_cpu/)
    draft_model: str | None = None  # alias, .gguf file or HF directory; same vocabulary as the target
    draft_device: str = "auto"  # auto | cpu | cuda: auto is the CPU unless the target is on a GPU and < 4 cores
    draft_dtype: str = "auto"  # auto: the target's on the same device, else bfloat16 on CUDA/bf16 CPUs, float32
    draft_backend: str = "auto"  # auto | ipex | torch (CPU): auto takes IPEX when it imports
    draft_quantization: str = "auto"  # auto | none | int8 | int4 (weight-only; draft_cpu.backends)
    draft_cpu_cores: str | None = None  # e.g. "0-15"; None: all but one core with a GPU target, unpinned on CPU
    draft_min_path_prob: float = 0.2  # stop a draft chain when its draft path probability falls below this
    draft_overlap: str = "auto"  # auto | on | off: draft ahead while the target verifies (auto: when on other cores)
    # Medusa heads (speculator "medusa"; speculators/medusa.py), placed by draft_device / draft_dtype
    medusa_heads: str | None = None  # checkpoint directory or .safetensors file (public Medusa layout)
    medusa_tree: str | None = None  # JSON list of top-k rank paths; None: every path with ranks summing to <= 2
    # the EAGLE head (speculator "eagle"; speculators/eagle.py), placed by draft_device / draft_dtype
    eagle_head: str | None = None  # checkpoint directory or file (public EAGLE layout)
    eagle_depth: int = DEFAULT_EAGLE_DEPTH  # EAGLE-2: expansion steps (the deepest draft); the tree width is its top-k

    def __post_init__(self) -> None:
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        if self.max_num_batched_tokens < 1:
            raise ValueError(f"max_num_batched_tokens must be >= 1, got {self.max_num_batched_tokens}")
        if self.block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {self.block_size}")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ValueError(f"max_model_len must be >= 2, got {self.max_model_len}")
        if self.dtype not in ("auto", "float32", "bfloat16", "float16"):
            raise ValueError(f"dtype must be auto, float32, bfloat16 or float16, got {self.dtype!r}")
        if self.attention_backend not in ATTENTION_BACKENDS:
            raise ValueError(f"attention_backend must be auto, torch or triton, got {self.attention_backend!r}")
        check_speculator(self.speculator)
        if self.num_speculative_tokens is not None and self.num_speculative_tokens < 0:
            raise ValueError(f"num_speculative_tokens must be >= 0, got {self.num_speculative_tokens}")
        if self.speculative_tree_width is not None and self.speculative_tree_width < 1:
            raise ValueError(f"speculative_tree_width must be >= 1, got {self.speculative_tree_width}")
        if not 1 <= self.prompt_lookup_min <= self.prompt_lookup_max:
            raise ValueError(f"need 1 <= prompt_lookup_min <= prompt_lookup_max, got {self.prompt_lookup_min} "
                             f"and {self.prompt_lookup_max}")
        if self.lookahead_global_nodes < 0:
            raise ValueError(f"lookahead_global_nodes must be >= 0, got {self.lookahead_global_nodes}")
        parts = speculator_parts(self.speculator)
        if "draft" in parts and not self.draft_model:
            raise ValueError("speculator 'draft' needs a draft model: --draft-model PATH (or draft_model=...)")
        if "eagle" in parts and not self.eagle_head:
            raise ValueError("speculator 'eagle' needs a trained head: --eagle-head DIR (or eagle_head=...; "
                             "scripts/train_eagle.py trains one)")
        if self.eagle_depth < 1:
            raise ValueError(f"eagle_depth must be >= 1, got {self.eagle_depth}")
        if "medusa" in parts and not self.medusa_heads:
            raise ValueError("speculator 'medusa' needs trained heads: --medusa-heads DIR (or medusa_heads=...; "
                             "scripts/train_medusa.py trains them)")
        if self.draft_device not in DRAFT_DEVICES and not self.draft_device.startswith("cuda:"):
            raise ValueError(f"draft_device must be auto, cpu or cuda, got {self.draft_device!r}")
        if self.draft_dtype not in ("auto", "float32", "bfloat16", "float16"):
            raise ValueError(f"draft_dtype must be auto, float32, bfloat16 or float16, got {self.draft_dtype!r}")
        if self.draft_backend not in ("auto", "ipex", "torch"):
            raise ValueError(f"draft_backend must be auto, ipex or torch, got {self.draft_backend!r}")
        if self.quantization not in QUANTIZATIONS:
            raise ValueError(f"quantization must be one of {', '.join(QUANTIZATIONS)}, got {self.quantization!r}")
        if self.draft_quantization not in QUANTIZATIONS:
            raise ValueError(f"draft_quantization must be one of {', '.join(QUANTIZATIONS)}, "
                             f"got {self.draft_quantization!r}")
        if self.draft_overlap not in ("auto", "on", "off"):
            raise ValueError(f"draft_overlap must be auto, on or off, got {self.draft_overlap!r}")
        if not 0.0 <= self.draft_min_path_prob < 1.0:
            raise ValueError(f"draft_min_path_prob must be in [0, 1), got {self.draft_min_path_prob}")

    def resolved_device(self) -> torch.device:
        if self.device == "auto":
            return torch.device("cuda" if torch.cuda.is_available() else "cpu")
        device = torch.device(self.device)
        if device.type == "cuda" and not torch.cuda.is_available():
            raise ValueError("device 'cuda' was asked for but torch sees no CUDA device")
        if device.type not in ("cpu", "cuda"):
            raise ValueError(f"device must be auto, cpu or cuda, got {self.device!r}")
        return device

    def resolved_dtype(self, device: torch.device) -> str:
        """auto: bfloat16 on CUDA and on CPUs with bf16 math (AMX: 4x faster matmuls than
        float32; AVX-512 BF16: 2.7x), float32 otherwise (oneDNN would emulate bf16)."""
        if self.dtype != "auto":
            return self.dtype
        return "bfloat16" if device.type == "cuda" or cpu_has_bf16_math() else "float32"

    def resolved_draft_device(self, target_device: torch.device) -> torch.device:
        """auto: the CPU (the point of this runtime), unless the target is on a GPU and the
        process has fewer than 4 cores, where a CPU draft would starve the engine loop."""
        import os
        if self.draft_device == "auto":
            if target_device.type == "cuda" and len(os.sched_getaffinity(0)) < 4:
                return target_device
            return torch.device("cpu")
        device = torch.device(self.draft_device)
        if device.type == "cuda" and not torch.cuda.is_available():
            raise ValueError("draft device 'cuda' was asked for but torch sees no CUDA device")
        return device

    def resolved_draft_dtype(self, draft_device: torch.device, target_device: torch.device,
                             target_dtype: str) -> str:
        if self.draft_dtype != "auto":
            return self.draft_dtype
        if draft_device.type == target_device.type:
            return target_dtype
        return "bfloat16" if draft_device.type == "cuda" or cpu_has_bf16_math() else "float32"

    def speculative_tokens(self, speculator: str) -> int:
        if speculator == "none":
            return 0
        if self.num_speculative_tokens is not None:
            return self.num_speculative_tokens
        return sum(DEFAULT_SPECULATIVE_TOKENS.get(part, 4) for part in speculator_parts(speculator))

    def tree_width(self, speculator: str) -> int:
        """The most children per node; of a combined speculator, its first part's (each
        part drafts with its own: speculators.composite)."""
        if self.speculative_tree_width is not None:
            return self.speculative_tree_width
        return DEFAULT_TREE_WIDTH.get(speculator_parts(speculator)[0], 1)

    def kv_cache_default_fraction(self, device: torch.device) -> float:
        return 0.8 if device.type == "cuda" else 0.1


def _speculator_arg(name: str) -> str:
    import argparse
    try:
        check_speculator(name)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return name


def add_engine_args(parser) -> None:
    """The flags shared by runtime.serve and runtime.generate: the target's attention backend
    and speculation; each defaults to None so that EngineConfig's default applies."""
    d = {name: f.default for name, f in EngineConfig.__dataclass_fields__.items()}
    parser.add_argument("--attention-backend", choices=ATTENTION_BACKENDS,
                        help="attention over the KV cache: torch (the PyTorch reference) or triton (CUDA kernels); "
                             f"default: {d['attention_backend']} = triton on CUDA when it can run there, else torch")
    parser.add_argument("--enforce-eager", action="store_true", default=None,
                        help="run every step eagerly: no CUDA graphs for a GPU target's decode and verify steps "
                             "(used with the triton attention backend), and no torch.compile'd decode step for a "
                             "CPU target or CPU draft model (compiled at start-up: minutes the first time on a "
                             "machine, seconds once Inductor's cache has it)")
    parser.add_argument("--no-cpu-weight-prepack", dest="cpu_weight_prepack", action="store_const", const=False,
                        help="a bf16 target on the CPU: leave its linear weights row-major instead of prepacking "
                             "them once into oneDNN's blocked layout (1.3x faster decode steps measured)")
    parser.add_argument("--quantization", choices=QUANTIZATIONS,
                        help="the target's linear weights: auto (default) keeps a GGUF file's precision class "
                             "(Q4_x/Q5_x -> int4, Q6_K/Q8_0 -> int8, F16/BF16/F32 -> float; an HF checkpoint as "
                             "stored), none dequantizes to --dtype, int8/int4 quantize every linear layer")
    g = parser.add_argument_group("speculative decoding")
    g.add_argument("--speculator", type=_speculator_arg, metavar="{" + ",".join(SPECULATORS) + "}[+...]",
                   help=f"proposer of draft tokens (default: {d['speculator']}; draft needs --draft-model, medusa "
                        "--medusa-heads, eagle --eagle-head); several joined by '+' draft together, their trees "
                        "merged, e.g. eagle+lookahead")
    g.add_argument("--num-speculative-tokens", type=int,
                   help="draft tokens (tree nodes) verified per sequence per step; default: "
                        + ", ".join(f"{k} for {n}" for n, k in DEFAULT_SPECULATIVE_TOKENS.items()))
    g.add_argument("--speculative-tree-width", type=int,
                   help="most children per draft node; 1 = chains, more = trees; default: "
                        + ", ".join(f"{w} for {n}" for n, w in DEFAULT_TREE_WIDTH.items()))
    g.add_argument("--prompt-lookup-min", type=int,
                   help=f"ngram/lookahead: shortest suffix to match (default: {d['prompt_lookup_min']})")
    g.add_argument("--prompt-lookup-max", type=int,
                   help=f"ngram/lookahead: longest suffix to match (default: {d['prompt_lookup_max']})")
    g.add_argument("--lookahead-global-nodes", type=int,
                   help="lookahead: node cap of a trie shared by all requests (least recently used first "
                        "out); 0 = off (default)")
    g.add_argument("--draft-model",
                   help="speculator draft: the draft model (alias, .gguf file or HF directory) with the target's "
                        "vocabulary")
    g.add_argument("--draft-device", choices=DRAFT_DEVICES,
                   help="where the draft model (or the Medusa or EAGLE heads) runs (default: auto = the CPU, unless the target is on a GPU and "
                        "fewer than 4 cores are available)")
    g.add_argument("--draft-dtype", choices=("auto", "float32", "bfloat16", "float16"),
                   help="draft model dtype (default: auto = the target's on the same device, else bfloat16 on "
                        "GPUs and CPUs with bf16 math (AMX, AVX-512 BF16), float32 otherwise)")
    g.add_argument("--draft-backend", choices=("auto", "ipex", "torch"),
                   help="CPU draft backend (default: auto = ipex when intel-extension-for-pytorch imports)")
    g.add_argument("--draft-quantization", choices=QUANTIZATIONS,
                   help="weight-only quantization of the draft model, as --quantization (default: auto); int8 "
                        "also quantizes a float draft (or heads), int4 quantizes whatever is left float")
    g.add_argument("--draft-cpu-cores",
                   help="pin the CPU draft worker to these cores, e.g. 0-15 or 0-3,8-11; the rest of the "
                        "process moves off them (default: all but one core with a GPU target; unpinned when "
                        "the target is on the CPU)")
    g.add_argument("--draft-min-path-prob", type=float,
                   help="stop extending a draft chain when its probability under the draft model falls below "
                        f"this (default: {d['draft_min_path_prob']})")
    g.add_argument("--draft-overlap", choices=("auto", "on", "off"),
                   help="keep drafting while the target verifies (default: auto = on when the draft has its own "
                        "device or cores)")
    g.add_argument("--medusa-heads",
                   help="speculator medusa: trained heads (a directory or .safetensors file in the public Medusa "
                        "layout; scripts/train_medusa.py makes them); they run where --draft-device says")
    g.add_argument("--medusa-tree",
                   help="speculator medusa: the candidate tree, a JSON list of top-k rank paths such as "
                        "[[0], [0, 0], [1]] (default: every path whose ranks sum to at most 2)")
    g.add_argument("--eagle-head",
                   help="speculator eagle: a trained EAGLE head (a directory or file in the public EAGLE layout; "
                        "scripts/train_eagle.py makes one); it runs where --draft-device says")
    g.add_argument("--eagle-depth", type=int,
                   help=f"speculator eagle: EAGLE-2 expansion steps, the deepest draft (default: {d['eagle_depth']}); "
                        "--speculative-tree-width is the top-k expanded per step")
    g.add_argument("--no-adaptive-speculation", dest="adaptive_speculation", action="store_const", const=False,
                   help="always propose --num-speculative-tokens instead of sizing drafts from measured "
                        "acceptance and step costs")


# EngineConfig fields set by add_engine_args' flags
ENGINE_ARGS = ("attention_backend", "enforce_eager", "cpu_weight_prepack", "quantization", "speculator",
               "num_speculative_tokens", "speculative_tree_width", "prompt_lookup_min", "prompt_lookup_max",
               "lookahead_global_nodes", "adaptive_speculation", "draft_model", "draft_device", "draft_dtype",
               "draft_backend", "draft_quantization", "draft_cpu_cores", "draft_min_path_prob", "draft_overlap",
               "medusa_heads", "medusa_tree", "eagle_head", "eagle_depth")
