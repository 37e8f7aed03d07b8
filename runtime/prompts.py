"""What a request's prompt may be, and its token ids."""
from __future__ import annotations

Prompt = str | list[dict] | list[int]  # text, chat messages, or token ids


def tokenize(tokenizer, prompt: Prompt, vocab_size: int) -> list[int]:
    """The prompt's token ids (chat messages through the tokenizer's chat template);
    ValueError when it is none of the three forms."""
    if isinstance(prompt, str):
        return tokenizer(prompt).input_ids
    if isinstance(prompt, list) and prompt and all(isinstance(m, dict) for m in prompt):
        for m in prompt:
            if not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
                raise ValueError("each chat message needs a string 'role' and a string 'content'")
        text = tokenizer.apply_chat_template(prompt, tokenize=False, add_generation_prompt=True)
        return tokenizer(text, add_special_tokens=False).input_ids
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
        if any(t < 0 or t >= vocab_size for t in prompt):
            raise ValueError(f"prompt token ids must be in [0, {vocab_size})")
        return list(prompt)
    raise ValueError("a prompt is a non-empty string, a non-empty list of chat messages, or a list of token ids")
