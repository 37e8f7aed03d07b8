"""Entry point: `python -m scripts.make_prompts` runs training/make_prompts.py (the
template prompt sets in training/data/)."""
from training.make_prompts import main

if __name__ == "__main__":
    raise SystemExit(main())
