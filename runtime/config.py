"""Engine configuration, validated once at start.

EngineConfig holds the engine's own settings (below) and every speculator's settings
block, taken from the speculator registry (speculators.registry): a new speculator's
settings become fields here and flags of runtime.serve and runtime.generate by
themselves."""
from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass

import torch

from runtime.models.loader import DEFAULT_MODEL, QUANTIZATIONS
from runtime.platform import cpu_has_bf16_math
from speculators import registry
from target_gpu.attention import ATTENTION_BACKENDS
from target_gpu.tp_launch import TPLaunch

DTYPES = ("auto", "float32", "bfloat16", "float16")


@dataclass(slots=True)
class EngineSettings:
    """The engine's own settings (EngineConfig adds the speculators')."""

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
    speculator: str = "none"  # none, a registered name (speculators.registry), or several joined by '+'
    num_speculative_tokens: int | None = None  # draft nodes verified per step; None: the speculator's default
    speculative_tree_width: int | None = None  # most children per draft node; 1 = chains; None: the speculator's default
    adaptive_speculation: bool = True  # size drafts per step from measured acceptance and costs
    speculators: str = ""  # more speculators built at start, comma-separated, for requests to ask for
    # a request may ask for a speculator that loads weights (draft, EAGLE, Medusa) that was not built at start:
    # True builds it then, holding up the engine (seconds); False refuses the request (the server's choice)
    load_speculators_on_request: bool = True
    # tensor parallelism (target_gpu.tensor_parallel); torchrun's environment, when present, decides instead
    tensor_parallel_size: int = 1  # target ranks, over all nodes; 1 = the target runs in this process
    nnodes: int = 1
    node_rank: int = 0  # this node; node 0 runs the engine and rank 0
    master_addr: str = "127.0.0.1"  # node 0's address, where ranks meet
    master_port: int | None = None  # None: a free port on one node, 29500 across nodes
    worker_timeout: float = 60.0  # seconds a rank may take to answer before the engine fails
    # context parallelism (target_gpu.context_parallel): long prompt chunks prefilled by ranks with ring attention
    context_parallel_size: int = 1  # rings of ranks, each of tensor_parallel_size ranks; 1 = none
    cp_min_tokens: int = 2048  # prompt chunks at least this long go around the ring

    def __post_init__(self) -> None:
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        if self.max_num_batched_tokens < 1:
            raise ValueError(f"max_num_batched_tokens must be >= 1, got {self.max_num_batched_tokens}")
        if self.block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {self.block_size}")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ValueError(f"max_model_len must be >= 2, got {self.max_model_len}")
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be auto, float32, bfloat16 or float16, got {self.dtype!r}")
        if self.attention_backend not in ATTENTION_BACKENDS:
            raise ValueError(f"attention_backend must be auto, torch or triton, got {self.attention_backend!r}")
        if self.quantization not in QUANTIZATIONS:
            raise ValueError(f"quantization must be one of {', '.join(QUANTIZATIONS)}, got {self.quantization!r}")
        if self.tensor_parallel_size < 1:
            raise ValueError(f"tensor_parallel_size must be >= 1, got {self.tensor_parallel_size}")
        if self.context_parallel_size < 1 or self.cp_min_tokens < 1:
            raise ValueError(f"context_parallel_size and cp_min_tokens must be >= 1, got "
                             f"{self.context_parallel_size} and {self.cp_min_tokens}")
        if self.context_parallel_size > 1 and (self.nnodes > 1 or self.resolved_device().type != "cpu"):
            raise ValueError("context parallelism runs on one node's CPU for now "
                             f"(--context-parallel-size {self.context_parallel_size} with --nnodes {self.nnodes}, "
                             f"device {self.device})")
        launch = self.tp_launch(environ={})  # checks the flags; torchrun's environment is read at start
        if launch is not None and launch.device_type == "cuda" and self.quantization not in ("auto", "none"):
            raise ValueError(f"tensor parallelism on CUDA shards float weights for now: "
                             f"quantization={self.quantization!r} cannot be split (use auto or none)")
        for name in self.start_speculators():
            registry.check_name(name)
        if self.num_speculative_tokens is not None and self.num_speculative_tokens < 0:
            raise ValueError(f"num_speculative_tokens must be >= 0, got {self.num_speculative_tokens}")
        if self.speculative_tree_width is not None and self.speculative_tree_width < 1:
            raise ValueError(f"speculative_tree_width must be >= 1, got {self.speculative_tree_width}")
        registry.check_config(self)

    def start_speculators(self) -> list[str]:
        """The speculators built at start (besides a draft model's): --speculator and --speculators."""
        listed = self.speculators.split(",") if isinstance(self.speculators, str) else self.speculators
        names = [self.speculator, *(name.strip() for name in listed)]
        return [name for name in dict.fromkeys(names) if name and name != "none"]

    def tp_launch(self, environ=None) -> TPLaunch | None:
        """Where the target's ranks run (None: one rank, in this process)."""
        import os
        if self.context_parallel_size > 1:  # a mesh of C x T ranks
            return TPLaunch(self.context_parallel_size * self.tensor_parallel_size, timeout_s=self.worker_timeout,
                            context_parallel_size=self.context_parallel_size)
        return TPLaunch.of(self.tensor_parallel_size, self.nnodes, self.node_rank, self.master_addr,
                           self.master_port, self.worker_timeout, lambda: self.resolved_device().type,
                           os.environ if environ is None else environ)

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
        """auto: bfloat16 on CUDA, else cpu_dtype's choice for the target."""
        if self.dtype != "auto":
            return self.dtype
        return "bfloat16" if device.type == "cuda" else cpu_dtype(self.model, self.quantization)

    def resolved_quantization(self, launch: TPLaunch | None) -> str:
        """auto under tensor parallelism on CUDA: none (float weights are what CUDA ranks split)."""
        if launch is not None and launch.device_type == "cuda" and self.quantization == "auto":
            logging.getLogger("runtime.engine").info("tensor parallelism on CUDA takes float weights: the target "
                                                     "loads with --quantization none")
            return "none"
        return self.quantization

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
        return with_index(device)

    def resolved_draft_dtype(self, draft_device: torch.device, target_device: torch.device,
                             target_dtype: str) -> str:
        if self.draft_dtype != "auto":
            return self.draft_dtype
        if draft_device.type == target_device.type:
            return target_dtype
        return "bfloat16" if draft_device.type == "cuda" else cpu_dtype(self.draft_model, self.draft_quantization)

    def speculative_tokens(self, speculator: str) -> int:
        if speculator == "none":
            return 0
        if self.num_speculative_tokens is not None:
            return self.num_speculative_tokens
        return registry.default_tokens(speculator)

    def tree_width(self, speculator: str) -> int:
        """The most children per node; of a combined speculator, its first part's (each
        part drafts with its own: speculators.composite)."""
        if self.speculative_tree_width is not None:
            return self.speculative_tree_width
        return registry.default_tree_width(speculator)

    def kv_cache_default_fraction(self, device: torch.device, ranks_per_host: int = 1) -> float:
        """Of free memory, for one rank's KV cache: 0.8 of a GPU's; 0.1 of the host's, shared
        by the ranks on it."""
        return 0.8 if device.type == "cuda" else 0.1 / ranks_per_host

    def draft_kv_fraction(self, draft_device: torch.device, target_device: torch.device) -> float:
        """Of free memory, at most, for a draft model's or head's KV pool: a KV cache's default
        share of its device, but half of what the target's pool left on the target's GPU
        (the rest is for activations and graphs)."""
        if draft_device == target_device and draft_device.type == "cuda":
            return 0.5
        return self.kv_cache_default_fraction(draft_device)


def cpu_dtype(model: str, quantization: str) -> str:
    """--dtype auto on the CPU for `model` loaded with `quantization`: bfloat16 on CPUs with
    bf16 math (AMX, AVX-512 BF16: faster matmuls than float32). On other CPUs float32 (oneDNN
    would emulate bf16), except where the model's linear layers stay int4/int8 and this CPU
    runs them in heterospec_cpu.quant_linear (AVX2 or better): its inputs are quantized to int8
    whatever the dtype, and with float32 the weights would be dequantized to float32 at load
    (quant_linear.DequantizedLinear: 4 to 8 times the bytes a step reads), so bfloat16 there."""
    if cpu_has_bf16_math():
        return "bfloat16"
    from runtime.models.cpu_kernels import has_vector_kernel
    from runtime.models.loader import keeps_quantized_linears
    return "bfloat16" if has_vector_kernel() and keeps_quantized_linears(model, quantization) else "float32"


def with_index(device: torch.device) -> torch.device:
    """cuda -> cuda:N (the current device), as tensors report it, so devices compare equal
    (it starts CUDA: call it where this process's device is set)."""
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return device


# the engine's settings and, after them, every registered speculator's (speculators.registry)
EngineConfig = dataclasses.make_dataclass(
    "EngineConfig", [(s.name, object, dataclasses.field(default=s.default)) for s in registry.all_settings()],
    bases=(EngineSettings,), slots=True)
EngineConfig.__module__ = __name__
EngineConfig.__doc__ = __doc__


def _speculator_arg(name: str) -> str:
    import argparse
    try:
        registry.check_name(name)
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
                             "them once into oneDNN's blocked layout")
    parser.add_argument("--quantization", choices=QUANTIZATIONS,
                        help="the target's linear weights: auto (default) keeps a GGUF file's precision class "
                             "(Q4_x/Q4_K/Q5_K/Q2_K/Q3_K -> int4, Q5_0/Q5_1/Q6_K/Q8_0 -> int8, F16/BF16/F32 -> "
                             "float; an HF checkpoint as stored), none dequantizes to --dtype, int8/int4 quantize "
                             "every linear layer")
    t = parser.add_argument_group("tensor parallelism (torchrun's RANK/WORLD_SIZE/MASTER_* environment is "
                                  "also accepted)")
    t.add_argument("--tensor-parallel-size", type=int,
                   help="split the target over this many ranks, on all nodes together (worker processes over "
                        "torch.distributed); default 1: the target runs in the engine's process. On CUDA, float "
                        "weights for now (--quantization auto or none)")
    t.add_argument("--nnodes", type=int, help="nodes the ranks are spread over (default: 1)")
    t.add_argument("--node-rank", type=int, help="this node's number; node 0 runs the engine, the others only "
                   "their ranks (default: 0)")
    t.add_argument("--master-addr", help="node 0's address, where the ranks meet (default: 127.0.0.1)")
    t.add_argument("--master-port", type=int, help="the port there (default: a free one on one node, 29500 "
                   "across nodes)")
    t.add_argument("--worker-timeout", type=float, help="seconds a rank may take to answer before the engine "
                   "fails, naming it (default: 60)")
    c = parser.add_argument_group("context parallelism")
    c.add_argument("--context-parallel-size", type=int,
                   help="prefill long prompt chunks over this many rings of ranks (worker processes; with "
                        "--tensor-parallel-size T, T ranks each, T x this many in all) with ring attention; "
                        "decoding stays in the first T ranks; one node's CPU for now (default: 1, none)")
    c.add_argument("--cp-min-tokens", type=int, help="prompt chunks at least this long go around the ring "
                   "(default: 2048)")
    g = parser.add_argument_group("speculative decoding")
    g.add_argument("--speculator", type=_speculator_arg, metavar="{" + ",".join(registry.names()) + "}[+...]",
                   help=f"proposer of draft tokens (default: {d['speculator']}); several joined by '+' draft "
                        "together, their trees merged, e.g. eagle+lookahead")
    specs = registry.speculators().values()
    g.add_argument("--num-speculative-tokens", type=int,
                   help="draft tokens (tree nodes) verified per sequence per step; default: "
                        + ", ".join(f"{spec.num_speculative_tokens} for {spec.name}" for spec in specs))
    g.add_argument("--speculative-tree-width", type=int,
                   help="most children per draft node; 1 = chains, more = trees; default: "
                        + ", ".join(f"{spec.tree_width} for {spec.name}" for spec in specs))
    for setting in registry.all_settings():
        default = "" if setting.default is None else f" (default: {setting.default})"
        g.add_argument("--" + setting.name.replace("_", "-"), type=setting.type, choices=setting.choices,
                       help=setting.help + default)
    g.add_argument("--speculators", metavar="NAME[,NAME...]",
                   help="more speculators to build at start, for requests to ask for by name (the server refuses "
                        "a request for one that loads weights and was not built at start: draft, eagle, medusa); "
                        "a draft model, when given, is always built")
    g.add_argument("--no-adaptive-speculation", dest="adaptive_speculation", action="store_const", const=False,
                   help="always propose --num-speculative-tokens instead of sizing drafts from measured "
                        "acceptance and step costs")


# EngineConfig fields that say how the engine speculates (LLMEngine.update_speculation may change them)
SPECULATION_ARGS = ("speculator", "speculators", "num_speculative_tokens", "speculative_tree_width",
                    "adaptive_speculation",
                    *(setting.name for setting in registry.all_settings()))
# EngineConfig fields set by add_engine_args' flags
ENGINE_ARGS = ("attention_backend", "enforce_eager", "cpu_weight_prepack", "quantization", "tensor_parallel_size",
               "nnodes", "node_rank", "master_addr", "master_port", "worker_timeout", "context_parallel_size",
               "cp_min_tokens", *SPECULATION_ARGS)
