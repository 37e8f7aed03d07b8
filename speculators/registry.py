"""The speculators this runtime knows. Each declares, in its own file, a `Speculator`: its
name, its default draft size and tree width, its settings block and how to build its
proposer. The engine's config fields (runtime.config.EngineConfig), the command-line flags
(runtime.config.add_engine_args) and the names the server's `speculation` field accepts
are all derived from this registry.

Adding a speculator: one new file declaring a `Speculator`, and one line in `_BUILT_IN`
(or, outside this package, `register(spec)` before runtime.config is imported).
"""
from __future__ import annotations

import importlib
from dataclasses import dataclass
from types import MappingProxyType
from typing import Callable, Mapping

NONE = "none"  # plain decoding


@dataclass(frozen=True, slots=True)
class Setting:
    """One engine setting of a speculator: an EngineConfig field and a --flag."""

    name: str  # the EngineConfig field; the flag is --name-with-dashes
    default: object
    help: str
    type: type = str  # what the flag's value parses to
    choices: tuple | None = None
    minimum: float | None = None  # inclusive
    below: float | None = None  # exclusive upper bound
    validate: Callable | None = None  # (value) -> None or ValueError, for what the above cannot say

    def check(self, value) -> None:
        """ValueError when value is not allowed."""
        if value is None:
            return
        if self.validate is not None:
            self.validate(value)
        if self.choices is not None and value not in self.choices:
            raise ValueError(f"{self.name} must be one of {', '.join(map(str, self.choices))}, got {value!r}")
        if self.minimum is not None and value < self.minimum:
            raise ValueError(f"{self.name} must be >= {self.minimum}, got {value}")
        if self.below is not None and value >= self.below:
            raise ValueError(f"{self.name} must be < {self.below}, got {value}")


@dataclass(frozen=True, slots=True)
class Speculator:
    name: str
    build: Callable  # (config: EngineConfig, target: TargetInfo) -> Proposer
    num_speculative_tokens: int  # draft nodes per step when neither flag nor request says
    tree_width: int = 1  # most children per node by default; 1 = chains
    settings: tuple[Setting, ...] = ()  # its block (settings shared with others are the same objects)
    requires: Callable | None = None  # (config) -> what is missing to run it, or None
    check: Callable | None = None  # (config) -> None or ValueError: settings that must agree
    loads_weights: bool = False  # building it loads a model or heads (seconds): a server builds it only at start


# module of each built-in speculator: it defines SPECULATOR
_BUILT_IN = (
    "speculators.ngram",
    "speculators.lookahead",
    "speculators.draft",
    "speculators.eagle",
    "speculators.medusa",
)
_registry: dict[str, Speculator] = {}


def register(spec: Speculator, replace: bool = False) -> None:
    """Add a speculator (replace=True: or put it in the place of one of that name)."""
    _load_built_in()
    if (spec.name in _registry and not replace) or spec.name == NONE or "+" in spec.name:
        raise ValueError(f"speculator name {spec.name!r} is taken or not allowed")
    for setting in spec.settings:
        other = next((s for s in all_settings() if s.name == setting.name), setting)
        if other is not setting:
            raise ValueError(f"setting {setting.name!r} of speculator {spec.name!r} is declared twice")
    _registry[spec.name] = spec


_loaded = False


def _load_built_in() -> None:
    global _loaded
    if not _loaded:
        _loaded = True
        for module in _BUILT_IN:
            spec = importlib.import_module(module).SPECULATOR
            _registry[spec.name] = spec


def speculators() -> Mapping[str, Speculator]:
    """The registered speculators by name (a read-only view: register() adds to it)."""
    _load_built_in()
    return MappingProxyType(_registry)


def names() -> tuple[str, ...]:
    """Every name a request may ask for on its own: "none" first."""
    return (NONE, *speculators())


def all_settings() -> list[Setting]:
    """Every speculator's settings, each once, in registry order."""
    _load_built_in()
    seen: dict[str, Setting] = {}
    for spec in _registry.values():
        for setting in spec.settings:
            seen.setdefault(setting.name, setting)
    return list(seen.values())


def parts(name: str) -> list[str]:
    """The speculators a name stands for: "eagle+lookahead" -> ["eagle", "lookahead"]."""
    return name.split("+")


def check_name(name: str) -> None:
    """ValueError unless name is "none", a registered speculator, or several distinct ones
    joined by '+' (their trees merged: speculators.composite)."""
    known = speculators()
    split = parts(name)
    if name == NONE or (len(split) == len(set(split)) and all(p in known for p in split)):
        return
    raise ValueError(f"unknown speculator {name!r}; choose one of {', '.join(names())}, or several distinct "
                     f"ones other than none joined by '+' (e.g. eagle+lookahead)")


def get(name: str) -> Speculator:
    spec = speculators().get(name)
    if spec is None:
        check_name(name)  # raises, saying what is allowed
        raise ValueError(f"{name!r} names several speculators; each part is registered on its own")
    return spec


def check_config(config) -> None:
    """ValueError when a setting is out of range, settings disagree, or a speculator built
    at start (config.start_speculators()) lacks what it needs (a model, a trained head)."""
    for setting in all_settings():
        setting.check(getattr(config, setting.name))
    for spec in speculators().values():
        if spec.check is not None:
            spec.check(config)
    for name in config.start_speculators():
        for part in parts(name):
            requires = get(part).requires
            missing = requires and requires(config)
            if missing:
                raise ValueError(f"speculator {part!r} needs {missing}")


def default_tokens(name: str) -> int:
    """Draft nodes per step by default; a combined speculator's parts each draft theirs."""
    return 0 if name == NONE else sum(get(p).num_speculative_tokens for p in parts(name))


def default_tree_width(name: str) -> int:
    """Of a combined speculator, its first part's."""
    return 1 if name == NONE else get(parts(name)[0]).tree_width


def build_proposer(name: str, config, target, part=None):
    """The proposer for a speculator name, from the engine's config and the target's
    TargetInfo. A combined name merges the trees of its parts, which part(part_name) gives:
    the engine's pool (runtime.proposer_pool), which owns and closes them and shares each
    with the requests that ask for that part alone (one draft worker, one EAGLE head)."""
    split = parts(name)
    if len(split) > 1:
        if part is None:
            raise ValueError(f"{name!r} combines speculators: its parts come from part(name)")
        from speculators.composite import CompositeProposer
        return CompositeProposer([part(p) for p in split], [get(p).num_speculative_tokens for p in split],
                                 [config.tree_width(p) for p in split])
    return get(name).build(config, target)
