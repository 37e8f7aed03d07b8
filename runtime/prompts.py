"""What a request's prompt may be, and its token ids."""
from __future__ import annotations

import weakref

from runtime.tool_calls import hermes_messages

# text, chat messages, chat messages with the tools the model may call ({"messages": [...],
# "tools": [...]}: OpenAI's function definitions, rendered by the chat template or, where it
# ignores tools, in the Hermes form), or token ids
Prompt = str | list[dict] | dict | list[int]


def tokenize(tokenizer, prompt: Prompt, vocab_size: int) -> list[int]:
    """The prompt's token ids (chat messages through the tokenizer's chat template);
    ValueError when it is none of the four forms."""
    if isinstance(prompt, str):
        return tokenizer(_unicode(prompt)).input_ids
    tools = None
    if isinstance(prompt, dict) and set(prompt) <= {"messages", "tools"} and isinstance(prompt.get("tools", []), list):
        prompt, tools = prompt.get("messages"), prompt.get("tools")
    if isinstance(prompt, list) and prompt and all(isinstance(m, dict) for m in prompt):
        for m in prompt:
            if not isinstance(m.get("role"), str) or not (isinstance(m.get("content"), str) or m.get("tool_calls")):
                raise ValueError("each chat message needs a string 'role' and a string 'content' (or, from the "
                                 "assistant, 'tool_calls')")
        return tokenizer(_unicode(chat_text(tokenizer, prompt, tools)), add_special_tokens=False).input_ids
    if is_token_ids(prompt):
        if any(t < 0 or t >= vocab_size for t in prompt):
            raise ValueError(f"prompt token ids must be in [0, {vocab_size})")
        return list(prompt)
    raise ValueError("a prompt is a non-empty string, a non-empty list of chat messages (or {'messages': [...], "
                     "'tools': [...]}, tools optional), or a list of token ids")


def is_token_ids(value) -> bool:
    """A non-empty list of ints (not bools: True is an int to Python, not to JSON)."""
    return isinstance(value, list) and bool(value) and all(isinstance(t, int) and not isinstance(t, bool)
                                                          for t in value)


def _unicode(text: str) -> str:
    """text, or ValueError when it cannot be encoded (a lone surrogate such as "\\ud800")."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise ValueError(f"the prompt is not valid Unicode ({e.reason} at character {e.start})") from None
    return text


def chat_text(tokenizer, messages: list[dict], tools: list[dict] | None) -> str:
    """messages through the chat template, with the tools: the template's own way, or, where
    it ignores tools, in the Hermes form (runtime.tool_calls.hermes_messages)."""
    if tools and not renders_tools(tokenizer):
        messages, tools = hermes_messages(messages, tools), None
    return tokenizer.apply_chat_template(messages, tools=tools, tokenize=False, add_generation_prompt=True)


_renders_tools: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # tokenizer -> bool
_PROBE_MESSAGES = [{"role": "user", "content": "What time is it?"}]
_PROBE_TOOLS = [{"type": "function", "function": {"name": "get_time", "description": "The current time.",
                                                  "parameters": {"type": "object", "properties": {}}}}]


def renders_tools(tokenizer) -> bool:
    """Whether the tokenizer's chat template shows the model a tools list: asked once per
    tokenizer, with one user message and one function (a template does not change)."""
    known = _renders_tools.get(tokenizer)
    if known is None:
        render = tokenizer.apply_chat_template
        known = _renders_tools[tokenizer] = render(_PROBE_MESSAGES, tools=_PROBE_TOOLS, tokenize=False,
                                                   add_generation_prompt=True) != \
            render(_PROBE_MESSAGES, tokenize=False, add_generation_prompt=True)
    return known
