"""Entry point: `python -m scripts.make_self_prompts` runs training/make_self_prompts.py
(prompts the target asks itself)."""
from training.make_self_prompts import main

if __name__ == "__main__":
    raise SystemExit(main())
