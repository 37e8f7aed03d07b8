"""Training speculation heads by self-distillation, apart from the inference packages.

The inference packages (runtime, target_gpu, draft_cpu, speculators) never import this
one; it imports them (the engine writes the corpus, the heads come from speculators), and
it is not part of the wheel. Run from the repository root:

  common.py            the corpus (the target answers a prompt set), the target's states,
                       the shared flags, optimizer and draft vocabulary
  eagle.py, medusa.py  each head's data, loss, validation and training loop
  make_prompts.py      writes the template prompt sets (python -m training.make_prompts)
  make_self_prompts.py writes prompts the target asks itself (the Magpie method)
  data/                the prompt sets and the default model's answers

The entry points are scripts/train_eagle.py and scripts/train_medusa.py
(`python -m scripts.train_eagle --help`).
"""
