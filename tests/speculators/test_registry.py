"""The speculator registry (speculators.registry): adding a speculator is one file that
declares it and one line that registers it. A toy speculator added so here becomes a name
requests may ask for, an EngineConfig field and a flag for each of its settings, and a
name the server's `speculation` field accepts; its drafts verify losslessly."""
import argparse
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from runtime.draft_tree import DraftTree
from speculators.base import Proposer
from speculators.registry import Setting, Speculator, names, register
from tests.helpers import greedy, new_engine

ROOT = Path(__file__).resolve().parents[2]


class RepeatLast(Proposer):
    """Drafts a chain of the last token repeated (right on repetitive text, wrong elsewhere)."""

    name = "repeat"

    def __init__(self, length: int):
        self.length = length

    def propose(self, requests):
        return [DraftTree([r.token_ids[-1]] * min(self.length, r.max_nodes), list(range(-1, min(self.length, r.max_nodes) - 1)))
                for r in requests]


TOY = Speculator("repeat", lambda config, target: RepeatLast(3), num_speculative_tokens=3)


def test_a_registered_toy_speculator_drafts_losslessly(engine_f32, generate):
    if "repeat" not in names():
        register(TOY)  # the one registry line
    prompts = ["a a a a a a a a a a a a", "The capital of France is"]
    plain = generate(engine_f32, prompts, greedy(24))
    engine = new_engine(adaptive_speculation=False)
    try:
        assert generate(engine, prompts, greedy(24, speculator="repeat")) == plain
        assert engine.stats.num_draft_tokens > 0 and engine.stats.num_accepted_tokens > 0
        assert generate(engine, prompts, greedy(24, speculator="repeat+ngram")) == plain  # and combined
    finally:
        engine.close()


def test_a_speculators_settings_become_config_fields_flags_and_server_names(tmp_path):
    """In a fresh interpreter (the config is derived when runtime.config is first imported),
    a toy speculator with a settings block, registered first: its setting is an EngineConfig
    field with its default, a flag of the shared parser, range-checked; the server accepts
    its name."""
    module = tmp_path / "toy_speculator.py"
    module.write_text(textwrap.dedent('''
        from speculators.registry import Setting, Speculator, register
        from speculators.ngram import NGramProposer

        register(Speculator("toy", lambda config, target: NGramProposer(1, config.toy_window),
                            num_speculative_tokens=2,
                            settings=(Setting("toy_window", 3, "toy: longest suffix matched", int, minimum=1),)))
    '''))
    script = textwrap.dedent('''
        import argparse, json
        import toy_speculator
        from runtime.config import EngineConfig, add_engine_args
        from runtime.openai_protocol import CompletionRequest
        parser = argparse.ArgumentParser()
        add_engine_args(parser)
        args = parser.parse_args(["--speculator", "toy", "--toy-window", "5"])
        config = EngineConfig(speculator=args.speculator, toy_window=args.toy_window)
        try:
            EngineConfig(toy_window=0)
            refused = False
        except ValueError as e:
            refused = "toy_window" in str(e)
        request = CompletionRequest(model="m", prompt="hi", speculation={"method": "toy"})
        print(json.dumps([EngineConfig().toy_window, config.toy_window, config.speculative_tokens("toy"),
                          refused, request.sampling_params(1, 100)[0].speculator]))
    ''')
    out = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True,
                         env={"PYTHONPATH": f"{tmp_path}:{ROOT}", "PATH": "/usr/bin:/bin", "HF_HUB_OFFLINE": "1"})
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == '[3, 5, 2, true, "toy"]'


def test_a_name_or_setting_taken_twice_is_refused():
    with pytest.raises(ValueError, match="taken"):
        register(Speculator("ngram", lambda config, target: None, 1))
    with pytest.raises(ValueError, match="declared twice"):
        register(Speculator("twice", lambda config, target: None, 1,
                            settings=(Setting("prompt_lookup_max", 2, "again", int),)))
    assert "twice" not in names()


def test_the_flags_list_every_registered_setting():
    from runtime.config import ENGINE_ARGS, add_engine_args
    from speculators.registry import all_settings
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    dests = {action.dest for action in parser._actions}
    for setting in all_settings():
        assert setting.name in dests and setting.name in ENGINE_ARGS
