"""What every benchmark shares: the systems under test, the measurement, the HF transformers
reference, the Markdown table, the plot and the results files.

- `System`: one row of a benchmark: HF transformers (speculator None) or this engine with a
  speculator and its settings; `Speculation` switches an engine between systems through
  `LLMEngine.update_speculation` (the public way, never by assigning engine attributes).
- `Measure` and `interleaved`: a warm-up of every system, then rounds in which the systems
  take turns, so that drifting machine load hits them alike; the median round is reported,
  and ratios against a peer measured in the same run.
- `load_hf`, `hf_generate`, `hf_prompt_ids`: the HF transformers reference on the same
  model, dtype and prompt token ids.
- `Report`: prints a run's text and tables as they come and writes them at the end to
  benchmarks/results/<YYYY-MM-DD>-<name>.md and .json (and .png where the bench plots),
  stamped with the commit, CPU, cores, torch and transformers versions and GPU.

Scripts import it as `from scripts.harness import ...` and run from the repository root as
`python -m scripts.bench_<name>`.
"""
from __future__ import annotations

import argparse
import dataclasses
import datetime
import importlib.metadata
import json
import math
import os
import platform
import shlex
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterable, NamedTuple, Sequence

import torch

ROOT = Path(__file__).resolve().parents[1]
RESULTS_DIR = ROOT / "benchmarks" / "results"


def log(*parts) -> None:
    """Progress: to stderr, so that stdout carries only the results."""
    print(*parts, file=sys.stderr, flush=True)


# ---- the machine --------------------------------------------------------------------------------

def git_commit() -> str:
    """The short commit hash, with "-dirty" when tracked files differ from it."""
    def git(*args: str) -> str:
        try:
            return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True).stdout.strip()
        except OSError:
            return ""
    commit = git("rev-parse", "--short", "HEAD") or "unknown"
    if git("status", "--porcelain", "--untracked-files=no"):
        commit += "-dirty"
    return commit


def cpu_model() -> str:
    try:
        return next(line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                    if line.startswith("model name"))
    except (OSError, StopIteration):
        return platform.processor() or "unknown"


def machine() -> dict[str, str | int | None]:
    """{"commit", "cpu", "cores", "usable_cores", "torch", "transformers", "gpu"}; transformers
    and gpu are None when absent."""
    try:
        transformers = importlib.metadata.version("transformers")
    except importlib.metadata.PackageNotFoundError:
        transformers = None
    gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else None
    return {"commit": git_commit(), "cpu": cpu_model(), "cores": os.cpu_count(),
            "usable_cores": len(os.sched_getaffinity(0)), "torch": torch.__version__,
            "transformers": transformers, "gpu": gpu}


def machine_line(info: dict) -> str:
    line = (f"commit {info['commit']}; CPU {info['cpu']}, {info['cores']} cores ({info['usable_cores']} usable); "
            f"torch {info['torch']}")
    if info.get("transformers"):
        line += f", transformers {info['transformers']}"
    if info.get("gpu"):
        line += f"; GPU {info['gpu']}"
    return line


# ---- results files ------------------------------------------------------------------------------

def add_results_args(parser: argparse.ArgumentParser, name: str) -> None:
    """--name: the results files' name, benchmarks/results/<date>-<name>.{md,json,png}."""
    parser.add_argument("--name", default=name, help="results files: benchmarks/results/<date>-NAME.md, .json "
                                                     "(default: %(default)s)")


def results_path(name: str, suffix: str, date: datetime.date | None = None) -> Path:
    return RESULTS_DIR / f"{(date or datetime.date.today()).isoformat()}-{name}{suffix}"


def command_line(module: str, argv: Sequence[str] | None) -> str:
    return shlex.join(["python", "-m", module, *(sys.argv[1:] if argv is None else argv)])


def _jsonable(value):
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)  # strict JSON has no Infinity or NaN
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if isinstance(value, Path):
        return str(value)
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return _jsonable(dataclasses.asdict(value))
    if isinstance(value, (str, int, float, bool)) or value is None:
        return value
    return str(value)


class Report:
    """A run's results: `line` and `table` print to stdout and are kept; `data` holds the
    figures for the JSON file; `write` writes benchmarks/results/<date>-<name>.md and .json
    (and .png, when given a plot and matplotlib is installed), stamped with the machine."""

    def __init__(self, name: str, title: str, module: str, argv: Sequence[str] | None = None,
                 args: argparse.Namespace | None = None):
        self.name, self.title = name, title
        self.command = command_line(module, argv)
        self.args = vars(args) if args is not None else {}
        self.date = datetime.date.today()
        self.started = datetime.datetime.now()
        self.machine = machine()
        self.lines: list[str] = []
        self.data: dict = {}

    def line(self, text: str = "") -> None:
        print(text, flush=True)
        self.lines.append(text)

    def table(self, header: Sequence[str], rows: Iterable[Sequence], align: str | None = None) -> None:
        self.line(markdown_table(header, rows, align))

    def paths(self, output: str | Path | None = None) -> dict[str, Path]:
        md = Path(output) if output else results_path(self.name, ".md", self.date)
        return {"md": md, "json": md.with_suffix(".json"), "png": md.with_suffix(".png")}

    def write(self, output: str | Path | None = None, plot: Callable | None = None) -> dict[str, Path]:
        """-> the paths written. plot(plt) draws and returns a matplotlib figure."""
        paths = self.paths(output)
        paths["md"].parent.mkdir(parents=True, exist_ok=True)
        written = {}
        if plot is not None and save_plot(paths["png"], plot):
            written["png"] = paths["png"]
        info = self.machine
        head = [f"# {self.title} ({self.started.isoformat(timespec='seconds')})", "",
                f"- command: `{self.command}`", f"- {machine_line(info)}"]
        if "png" in written:
            head.append(f"- plot: [{paths['png'].name}]({paths['png'].name})")
        paths["md"].write_text("\n".join(head + ["", *self.lines, ""]))
        written["md"] = paths["md"]
        record = {"name": self.name, "title": self.title, "date": self.date.isoformat(),
                  "started": self.started.isoformat(timespec="seconds"),
                  "wall_s": round((datetime.datetime.now() - self.started).total_seconds(), 1), "command": self.command,
                  "machine": info, "args": self.args, "results": self.data}
        paths["json"].write_text(json.dumps(_jsonable(record), indent=1) + "\n")
        written["json"] = paths["json"]
        log("wrote " + ", ".join(str(p.relative_to(ROOT) if p.is_relative_to(ROOT) else p)
                                 for p in written.values()))
        return written


# ---- table and plot -----------------------------------------------------------------------------

def markdown_table(header: Sequence[str], rows: Iterable[Sequence], align: str | None = None) -> str:
    """A padded Markdown table; align: one "l" or "r" per column (default: the first left,
    the rest right)."""
    table = [[str(c) for c in header]] + [[str(c) for c in row] for row in rows]
    align = align or "l" + "r" * (len(header) - 1)
    widths = [max(len(row[i]) for row in table) for i in range(len(header))]
    out = []
    for n, row in enumerate(table):
        out.append("| " + " | ".join(c.ljust(w) if a == "l" else c.rjust(w)
                                     for c, w, a in zip(row, widths, align)) + " |")
        if n == 0:
            out.append("|" + "|".join("-" * (w + 1) + (":" if a == "r" else "-") for w, a in zip(widths, align)) + "|")
    return "\n".join(out)


def save_plot(path: Path, draw: Callable) -> bool:
    """draw(plt) -> a figure, saved to path; False (and a note) when matplotlib is missing."""
    try:
        import matplotlib
    except ImportError:
        log(f"note: no plot written to {path}: matplotlib is not installed (pip install matplotlib)")
        return False
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig = draw(plt)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


def ratio(a: float | None, b: float | None) -> str:
    """"a / b" as "1.23x", "-" when either is missing."""
    return f"{a / b:.2f}x" if a is not None and b else "-"


def fmt(value: float | None, spec: str = ".1f") -> str:
    return "-" if value is None else format(value, spec)


def median(values: Iterable[float | None]) -> float | None:
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


# ---- systems ------------------------------------------------------------------------------------

@dataclass(frozen=True)
class System:
    """One row of a benchmark. speculator None: an HF transformers row (hf_lookup: its
    prompt_lookup_num_tokens, hf_assisted: the draft model as assistant_model); else this
    engine with that speculator ("none": plain decoding) and `settings`: speculation settings
    of EngineConfig (speculative_tree_width, num_speculative_tokens, adaptive_speculation,
    eagle_head, draft_backend, ...) that `Speculation` applies with update_speculation;
    `engine`: target settings (dtype, quantization, enforce_eager, ...) that need an engine of
    their own. A dict passed for settings or engine is kept as sorted pairs."""

    key: str
    label: str
    speculator: str | None = None
    settings: tuple = ()
    engine: tuple = ()
    hf_lookup: int = 0
    hf_assisted: bool = False

    def __post_init__(self):
        for name in ("settings", "engine"):
            value = getattr(self, name)
            if isinstance(value, dict):
                object.__setattr__(self, name, tuple(sorted(value.items())))

    @property
    def is_hf(self) -> bool:
        return self.speculator is None

    @property
    def speculates(self) -> bool:
        return self.speculator not in (None, "none")

    def setting(self, name: str, default=None):
        return dict(self.settings).get(name, default)

    def speculation(self) -> dict:
        """The keyword arguments of update_speculation for this system."""
        return {"speculator": self.speculator, **dict(self.settings)}

    def replace(self, **changes) -> "System":
        return dataclasses.replace(self, **changes)


class TreeSize(NamedTuple):
    """An EAGLE draft tree: expansion steps, top-k per expansion, nodes verified."""
    depth: int
    width: int
    nodes: int

    def __str__(self) -> str:
        return f"depth {self.depth}, top-{self.width}, {self.nodes} nodes"

    def settings(self) -> dict:
        return {"eagle_depth": self.depth, "speculative_tree_width": self.width, "num_speculative_tokens": self.nodes}


# EAGLE-2's published tree for GPU targets (6 expansion steps, top-10, 60 verified nodes), against
# the engine's CPU-sized default (speculators/eagle.py)
PAPER_TREE = TreeSize(depth=6, width=10, nodes=60)


def select_systems(systems: list[System], wanted: str | Sequence[str] | None, keep: Sequence[str] = (),
                   note: str = "") -> list[System]:
    """The systems named in `wanted` (a comma list; None or empty: all), in their own order,
    plus those in `keep`; SystemExit on an unknown name."""
    if not wanted:
        return list(systems)
    names = [w.strip() for w in (wanted.split(",") if isinstance(wanted, str) else wanted) if w.strip()]
    unknown = set(names) - {s.key for s in systems}
    if unknown:
        raise SystemExit(f"unknown system(s): {', '.join(sorted(unknown))}{note}; known: "
                         + ", ".join(s.key for s in systems))
    return [s for s in systems if s.key in names or s.key in keep]


class Speculation:
    """Switches one engine between systems with `engine.update_speculation(**settings)`
    (public API: it validates the settings, needs the engine idle and rebuilds the
    proposers). Every switch passes every setting any of the systems sets, the ones a system
    leaves out at the engine's own value when the switch was made, so no system inherits
    another's settings; `common` applies to all (e.g. adaptive_speculation). A switch to the
    settings already in place does nothing."""

    def __init__(self, engine, systems: Iterable[System], **common):
        self.engine = engine
        keys = {k for s in systems if not s.is_hf for k, _ in s.settings} | set(common)
        self.base = {k: getattr(engine.config, k) for k in sorted(keys)}
        self.common = common
        self.current: dict | None = None

    def settings(self, system: System) -> dict:
        return {**self.base, **self.common, **system.speculation()}

    def switches(self, system: System) -> bool:
        """Whether use(system) would rebuild the engine's proposers."""
        return not system.is_hf and self.settings(system) != self.current

    def use(self, system: System) -> None:
        if not self.switches(system):
            return
        settings = self.settings(system)
        update = getattr(self.engine, "update_speculation", None)
        if update is None:
            raise SystemExit("this engine has no update_speculation(): the benchmarks switch speculation through "
                             "it (runtime/engine.py)")
        update(**settings)
        self.current = settings


# ---- measurement --------------------------------------------------------------------------------

@dataclass
class Measure:
    """One system's timed rounds and speculation counters."""

    rounds: list[tuple[int, float]] = field(default_factory=list)  # (output tokens, seconds) per timed round
    outputs: list[list[int]] | None = None  # token ids of the first timed round, one per prompt
    drafted: int = 0
    accepted: int = 0
    verify_steps: int = 0

    def add_round(self, tokens: int, seconds: float, outputs: list[list[int]] | None = None) -> None:
        self.rounds.append((tokens, seconds))
        if self.outputs is None and outputs is not None:
            self.outputs = outputs

    def add_metrics(self, results) -> None:
        """Speculation counters of finished requests (their RequestMetrics)."""
        for r in results:
            self.drafted += r.metrics.num_draft_tokens
            self.accepted += r.metrics.num_accepted_tokens
            self.verify_steps += r.metrics.num_verify_steps

    @property
    def rate(self) -> float | None:
        """The median round's output tok/s."""
        return statistics.median(n / s for n, s in self.rounds) if self.rounds else None

    @property
    def rates(self) -> list[float]:
        return [n / s for n, s in self.rounds]

    @property
    def acceptance_length(self) -> float | None:
        """Tokens per verify step: 1 + accepted / verify steps."""
        return 1 + self.accepted / self.verify_steps if self.verify_steps else None

    def same_outputs(self, other: "Measure | None") -> str:
        """"k/n": prompts whose output tokens equal other's; "-" without both."""
        if other is None or other is self or self.outputs is None or other.outputs is None:
            return "-"
        return f"{sum(a == b for a, b in zip(self.outputs, other.outputs))}/{len(self.outputs)}"

    def summary(self) -> dict:
        return {"tok_per_s": self.rate, "rounds_tok_per_s": self.rates, "acceptance_length": self.acceptance_length,
                "draft_tokens": self.drafted, "accepted_tokens": self.accepted, "verify_steps": self.verify_steps}


def interleaved(systems: Sequence, repeats: int, run: Callable, warm: Callable | None = None,
                label: Callable = lambda s: s.label, measures: dict | None = None) -> dict:
    """Warm every system up once (warm(system)), then `repeats` rounds, the systems in turn:
    run(system, measure) times one round and records it in measure. -> {system key: Measure}.
    Items may be Systems or any objects with a .key (label names them in the progress lines)."""
    measures = {s.key: Measure() for s in systems} if measures is None else measures
    if warm is not None:
        for s in systems:
            warm(s)
    for r in range(repeats):
        for s in systems:
            m = measures[s.key]
            before = len(m.rounds)
            run(s, m)
            for tokens, seconds in m.rounds[before:]:
                log(f"round {r + 1}/{repeats} {label(s):48s} {tokens:5d} tokens {seconds:7.2f} s "
                    f"{tokens / seconds:7.1f} tok/s")
    return measures


# ---- this engine --------------------------------------------------------------------------------

def greedy(max_tokens: int, ignore_eos: bool = False, **kwargs):
    from runtime import SamplingParams
    return SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=ignore_eos, **kwargs)


def run_engine(llm, prompts: list, max_tokens: int, ignore_eos: bool = False, **params) -> tuple[int, float, list]:
    """All prompts at once, greedy -> (output tokens, seconds, results). params: more
    SamplingParams fields (e.g. speculator, num_speculative_tokens)."""
    results = llm.generate(prompts, greedy(max_tokens, ignore_eos, **params), use_tqdm=False)
    summary = llm.last_summary
    return summary.num_output_tokens, summary.elapsed_s, results


def one_at_a_time(llm, prompts: list, max_tokens: int, ignore_eos: bool = False,
                  **params) -> tuple[int, float, list]:
    """The prompts one after another (single stream) -> (output tokens, seconds, results)."""
    tokens, seconds, results = 0, 0.0, []
    for prompt in prompts:
        n, s, res = run_engine(llm, [prompt], max_tokens, ignore_eos, **params)
        tokens, seconds, results = tokens + n, seconds + s, results + res
    return tokens, seconds, results


def proposers(engine) -> dict:
    """The engine's built proposers by speculator name (read only: to time or label them)."""
    pool = getattr(engine, "pool", None)
    found = getattr(pool, "proposers", None) if pool is not None else getattr(engine, "proposers", None)
    return found if isinstance(found, dict) else {}


def draft_backend(engine) -> str:
    """The backend the engine's draft worker runs ("ipex", "torch"), "-" when none is loaded."""
    worker = getattr(proposers(engine).get("draft"), "worker", None)
    return str(getattr(worker, "backend", "-"))


def _prompts_module():
    """The shipped prompt sets live with the training code (training/data), which the
    inference packages never import; the benchmarks read them from there."""
    from training import common
    return common


def prompt_file(split: str) -> Path:
    """A prompt set shipped in the repository: "train", "train_large", "train_varied", "heldout"."""
    return _prompts_module().default_prompt_file(split)


def load_prompt_file(path: str | Path, limit: int | None = None) -> list:
    """Prompts from JSONL lines {"prompt": ...} or {"messages": [...]}."""
    return _prompts_module().load_prompts(path, limit)


def prompt_set(split: str, limit: int | None = None) -> list:
    return load_prompt_file(prompt_file(split), limit)


# ---- HF transformers, the reference -------------------------------------------------------------

HF_OVERSHOOT: list[int] = []  # tokens HF generated beyond max_new_tokens, per request that did


def load_hf(spec: str, dtype: torch.dtype, device: str | torch.device = "cpu"):
    """The model as HF transformers loads it (a GGUF file dequantized), in eval mode."""
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    from runtime.models.loader import resolve_model
    os.environ.setdefault("USE_HUB_KERNELS", "NO")  # transformers 5.25+: no hub kernels (a download)
    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    source = resolve_model(spec)
    if source.kind == "gguf":
        model = AutoModelForCausalLM.from_pretrained(str(source.path.parent), gguf_file=source.path.name,
                                                     torch_dtype=dtype)
    else:
        model = AutoModelForCausalLM.from_pretrained(str(source.path), torch_dtype=dtype)
    return model.to(device).eval()


def hf_pad_id(model) -> int:
    eos = model.generation_config.eos_token_id
    eos = eos[0] if isinstance(eos, (list, tuple)) else eos
    return 0 if eos is None else eos


def hf_generate(model, prompt_ids: list[int], max_tokens: int, *, eos_ids: list[int] | None = None,
                exact: bool = False, lookup: int = 0, assistant=None) -> tuple[int, float, list[int]]:
    """One greedy request with `generate` -> (output tokens, seconds, output ids). exact: every
    request generates max_tokens tokens (min_new_tokens); else it stops at eos_ids. lookup:
    prompt_lookup_num_tokens; assistant: a draft model (assisted generation). Tokens past
    max_tokens (assisted generation may accept them) are cut off and counted in HF_OVERSHOOT."""
    ids = torch.tensor([prompt_ids], device=model.device)
    extra = {}
    if lookup:
        extra["prompt_lookup_num_tokens"] = lookup
    if assistant is not None:
        extra["assistant_model"] = assistant
    if exact:
        extra.update(min_new_tokens=max_tokens, pad_token_id=hf_pad_id(model))
    else:
        extra.update(eos_token_id=eos_ids or None, pad_token_id=eos_ids[0] if eos_ids else hf_pad_id(model))
    start = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_tokens, do_sample=False,
                             temperature=None, top_p=None, top_k=None, **extra)
    tokens = out[0, ids.shape[1]:].tolist()  # .tolist() waits for the device
    elapsed = time.perf_counter() - start
    if len(tokens) > max_tokens:
        HF_OVERSHOOT.append(len(tokens) - max_tokens)
        tokens = tokens[:max_tokens]
    return len(tokens), elapsed, tokens


def hf_one_at_a_time(model, prompt_ids: list[list[int]], max_tokens: int, **kwargs) -> tuple[int, float, list]:
    """hf_generate over the prompts in turn -> (output tokens, seconds, output ids per prompt)."""
    tokens, seconds, outputs = 0, 0.0, []
    for ids in prompt_ids:
        n, s, out = hf_generate(model, ids, max_tokens, **kwargs)
        tokens, seconds = tokens + n, seconds + s
        outputs.append(out)
    return tokens, seconds, outputs


def hf_prompt_ids(spec: str, conversations: list, engine=None) -> tuple[list[list[int]], list[int]]:
    """HF's prompt token ids of chat conversations (its tokenizer's chat template), and the
    indices where the engine's own (engine.prompt_token_ids) differ."""
    from runtime.models.loader import load_tokenizer, resolve_model
    tokenizer = load_tokenizer(resolve_model(spec))
    ids, mismatched = [], []
    for i, conv in enumerate(conversations):
        ids.append(list(tokenizer.apply_chat_template(conv, add_generation_prompt=True, tokenize=True)))
        if engine is not None and ids[-1] != engine.prompt_token_ids(conv):
            mismatched.append(i)
    return ids, mismatched


def common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n
