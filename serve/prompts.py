"""What the gateway knows of a causal base: its tokenizer with its chat template, and its context.

The gateway renders chat messages with the base's chat template (or a specialist's own, from its
bundle), counts the prompt's tokens with the same tokenizer and refuses what does not fit the context
before anything is queued; the rendered prompt is what the task carries, so every runtime computes the
same tokens (`GenerateParams.chat`: no special tokens are added on top, as vLLM's chat route does).
The folder comes from `lorafleet.models.causal` (a packaged GGUF is converted once and cached), the context
from the base's `max_model_len` option or the model's config: the limit the runtimes use too.
Loaded once per base, in a thread, when the gateway starts.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from lorafleet.models.causal import CausalLMError, context_length, resolve_causal_source

DEFAULT_CONTEXT = 2048  # when neither the option nor the model's config says


class CausalPrompts:
    def __init__(self, source: str, options: Mapping[str, Any] | None = None, revision: str | None = None) -> None:
        from transformers import AutoTokenizer

        folder = resolve_causal_source(source)
        self.tokenizer = AutoTokenizer.from_pretrained(folder, revision=revision)
        self.context = context_length(folder, dict(options or {})) or DEFAULT_CONTEXT

    def render(self, messages: Sequence[Mapping[str, str]], chat_template: str | None = None) -> str:
        """The prompt text of a conversation, ready for the assistant's turn."""
        if chat_template is None and not self.tokenizer.chat_template:
            raise CausalLMError("this model has no chat template; use POST /v1/completions with a 'prompt'")
        return self.tokenizer.apply_chat_template([dict(m) for m in messages], chat_template=chat_template,
                                                  add_generation_prompt=True, tokenize=False)

    def count(self, text: str, chat: bool) -> int:
        """Tokens of a prompt as the runtime sees them: a rendered chat holds its special tokens already."""
        return len(self.tokenizer(text, add_special_tokens=not chat).input_ids)
