"""Prompt side of a request: the served model's tokenizer and context limit, and turning a
completion prompt or chat messages into token ids, with a 400 that says the lengths when too long.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from rngd_pd.frontend.api_errors import bad_request
from rngd_pd.frontend.schemas import ChatMessage
from rngd_pd.frontend.tools import ToolPlan, render_messages


class StreamDecoderLike(Protocol):
    def push(self, token_id: int) -> str: ...
    def flush(self) -> str: ...


class TokenizerLike(Protocol):
    """The part of rngd_pd.model.Tokenizer the front end uses."""

    eos_token_ids: tuple[int, ...]
    renders_tools: bool

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]: ...
    def decode(self, ids: Sequence[int]) -> str: ...
    def apply_chat_template(
        self, messages: list[dict], add_generation_prompt: bool = True, tools: list[dict] | None = None
    ) -> str: ...
    def stream_decoder(self) -> StreamDecoderLike: ...


@dataclass(frozen=True)
class ServedModel:
    """The model the front end serves, as far as the front end needs to know it (no weights)."""

    name: str
    tokenizer: TokenizerLike
    max_model_len: int
    vocab_size: int


def completion_prompt(model: ServedModel, prompt: str | list) -> list[int]:
    """A completion prompt (string, token ids, or a batch of one of either) -> token ids."""
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], str | list):
        prompt = prompt[0]  # the schema allows a batch of exactly one
    if isinstance(prompt, str):
        ids = model.tokenizer.encode(prompt)
    else:
        ids = list(prompt)
        bad = next((t for t in ids if not 0 <= t < model.vocab_size), None)
        if bad is not None:
            raise bad_request(
                f"token id {bad} in 'prompt' is outside the vocabulary [0, {model.vocab_size})",
                "prompt",
                "invalid_value",
            )
    if not ids:
        raise bad_request("'prompt' is empty: give at least one token", "prompt", "invalid_value")
    return ids


def chat_prompt(model: ServedModel, messages: list[ChatMessage], plan: ToolPlan | None = None,
                add_generation_prompt: bool = True) -> list[int]:
    """Messages (and tools) -> the model's chat template (with the assistant's turn opened unless
    add_generation_prompt is false) -> token ids; `rngd_pd.frontend.tools` says how tools reach a
    template that does not render them."""
    dicts, tools = render_messages(messages, plan or ToolPlan(), model.tokenizer.renders_tools)
    rendered = model.tokenizer.apply_chat_template(dicts, add_generation_prompt=add_generation_prompt,
                                                   tools=tools)
    ids = model.tokenizer.encode(rendered)
    if not ids:
        raise bad_request("'messages' render to an empty prompt", "messages", "invalid_value")
    return ids


def resolve_max_tokens(
    model: ServedModel, n_prompt: int, requested: int | None, default: int | None, prompt_param: str
) -> int:
    """The number of tokens to generate; 400 (saying the limit and the lengths) when it cannot fit.

    `default` None means "the rest of the context" (chat), as OpenAI-compatible servers do.
    """
    limit = model.max_model_len
    if n_prompt >= limit:
        raise bad_request(
            f"This model's maximum context length is {limit} tokens, but the {prompt_param} has {n_prompt} "
            f"tokens, leaving no room to generate. Please shorten the {prompt_param}.",
            prompt_param,
            "context_length_exceeded",
        )
    if requested is None:
        return min(default, limit - n_prompt) if default is not None else limit - n_prompt
    if n_prompt + requested > limit:
        raise bad_request(
            f"This model's maximum context length is {limit} tokens. However, you requested "
            f"{n_prompt + requested} tokens ({n_prompt} in the {prompt_param}, {requested} for the "
            "completion). "
            f"Please reduce the length of the {prompt_param} or the completion.",
            "max_tokens",
            "context_length_exceeded",
        )
    return requested
