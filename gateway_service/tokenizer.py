"""The gateway's tokenizer: the served model's Hugging Face tokenizer, used the way the in-process
engine (``pagedserve.LLM``) uses it, so both see the same token ids for the same input."""

from __future__ import annotations

from typing import Any

from servicekit.contract.errors import InvalidArgumentError


def load_hf_tokenizer(model: str) -> Any:
    """The tokenizer of ``model`` (a short name, a folder or a .gguf file)."""
    from transformers import AutoTokenizer

    from servicekit.model_registry import resolve_model

    source = resolve_model(model)
    return AutoTokenizer.from_pretrained(source.path, **source.from_pretrained_kwargs())


class PromptTokenizer:
    def __init__(self, hf_tokenizer: Any) -> None:
        self.hf = hf_tokenizer

    def encode_text(self, text: str) -> list[int]:
        """Plain text, special tokens added as the model does (as ``LLM.generate``)."""
        return list(self.hf.encode(text))

    def encode_chat(self, messages: list[dict[str, str]]) -> list[int]:
        """A conversation through the chat template with a generation prompt (as ``LLM.chat``)."""
        if not messages:
            raise InvalidArgumentError("chat", "at least one message is required")
        if getattr(self.hf, "chat_template", None) is None:
            raise InvalidArgumentError("chat", "the model has no chat template")
        text = self.hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        return list(self.hf.encode(text, add_special_tokens=False))
