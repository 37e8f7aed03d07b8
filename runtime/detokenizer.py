"""Incremental detokenization and stop strings.

Decoding the whole output every step is quadratic; instead each sequence keeps two
offsets into its output ids (as vLLM does): text is decoded over a short window, and a
token whose bytes do not yet form whole characters ("\ufffd") waits for the next one.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(slots=True)
class DetokenizerState:
    prefix_offset: int = 0
    read_offset: int = 0


class Detokenizer:
    def __init__(self, tokenizer):
        self.tokenizer = tokenizer

    def delta(self, output_ids: list[int], state: DetokenizerState) -> str:
        """New text since the last call (may be empty while a character is incomplete)."""
        decode = self.tokenizer.decode
        prefix = decode(output_ids[state.prefix_offset:state.read_offset], skip_special_tokens=True)
        full = decode(output_ids[state.prefix_offset:], skip_special_tokens=True)
        if full.endswith("\ufffd") or len(full) <= len(prefix):
            return ""
        state.prefix_offset = state.read_offset
        state.read_offset = len(output_ids)
        return full[len(prefix):]


def find_stop(text: str, new_len: int, stops: list[str]) -> int:
    """Index in `text` where the earliest stop string begins, looking only where the last
    `new_len` characters could complete one; -1 if none."""
    best = -1
    for stop in stops:
        start = max(0, len(text) - new_len - len(stop) + 1)
        at = text.find(stop, start)
        if at != -1 and (best == -1 or at < best):
            best = at
    return best
