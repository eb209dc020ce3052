"""Tokenizer (a `tokenizers` BPE built from GGUF metadata or read from tokenizer.json), chat template,
and a streaming detokenizer that never splits a UTF-8 character.

The runtime path imports neither transformers nor sentencepiece.
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import datetime

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers, processors
from tokenizers import Tokenizer as HFTokenizer

from rngd_pd.errors import ConfigError, ModelLoadError

# How llama.cpp's `tokenizer.ggml.pre` names split text before BPE (only what Llama-family uses).
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_LLAMA3_NAMES = ("llama3", "llama-v3", "llama-bpe", "smaug-bpe", "dbrx")
_CONTROL = 3  # GGUF token_type CONTROL: special tokens such as <|im_start|>
_USER_DEFINED = 4


def _pre_tokenizer(pre: str) -> pre_tokenizers.PreTokenizer:
    """Pre-tokenizer for a GGUF `tokenizer.ggml.pre` value (default: GPT-2 byte level)."""
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if pre in _LLAMA3_NAMES:
        return pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(_LLAMA3_SPLIT), behavior="isolated"),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )
    if pre == "smollm":  # \p{N} as single digits, then the GPT-2 split (as SmolLM's tokenizer.json)
        return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
    return byte_level


def tokenizer_from_gguf(
    tokens: list[str],
    merges: list[str],
    token_types: list[int],
    pre: str,
    model: str,
    bos_id: int | None = None,
) -> HFTokenizer:
    """Byte-level BPE equal to the checkpoint's own tokenizer, from GGUF tokenizer.ggml.* fields."""
    if model != "gpt2":
        raise ModelLoadError(
            f"GGUF tokenizer model {model!r} is not supported (only byte-level BPE 'gpt2', as Llama-3 "
            "and SmolLM use); use a Hugging Face checkpoint directory with tokenizer.json instead"
        )
    vocab = {tok: i for i, tok in enumerate(tokens)}
    pairs = [tuple(m.split(" ", 1)) for m in merges]
    tok = HFTokenizer(models.BPE(vocab, pairs, fuse_unk=False, byte_fallback=False))
    tok.pre_tokenizer = _pre_tokenizer(pre)
    tok.decoder = decoders.ByteLevel()
    if bos_id is not None:  # tokenizer.ggml.add_bos_token: encode() prepends BOS, as HF's does
        tok.post_processor = processors.TemplateProcessing(
            single=f"{tokens[bos_id]}:0 $A:0", special_tokens=[(tokens[bos_id], bos_id)]
        )
    special = [t for t, ty in zip(tokens, token_types, strict=False) if ty == _CONTROL]
    user = [t for t, ty in zip(tokens, token_types, strict=False) if ty == _USER_DEFINED]
    tok.add_special_tokens([AddedToken(t, normalized=False, special=True) for t in special])
    tok.add_tokens([AddedToken(t, normalized=False, special=False) for t in user])
    return tok


def _raise(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


class Tokenizer:
    """encode/decode, chat template and EOS ids of one model."""

    def __init__(
        self,
        tok: HFTokenizer,
        eos_token_ids: tuple[int, ...],
        chat_template: str | None = None,
        bos_token: str | None = None,
        eos_token: str | None = None,
    ) -> None:
        self.tok = tok
        self.eos_token_ids = eos_token_ids
        self.chat_template = chat_template
        self.bos_token, self.eos_token = bos_token, eos_token
        self._template: jinja2.Template | None = None
        self.vocab_size = tok.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of text, as Hugging Face's tokenizer(text) gives them by default: special tokens
        written in it (<|im_start|>) become their ids, and the checkpoint's own post-processor adds
        BOS where it wants one (Llama-3: yes; SmolLM: no). Pass False for an already templated
        prompt that starts with the BOS text."""
        return self.tok.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        """Text of ids (special tokens kept by default, as Hugging Face does)."""
        return self.tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def stream_decoder(self, skip_special_tokens: bool = False) -> StreamDecoder:
        return StreamDecoder(self, skip_special_tokens)

    @property
    def renders_tools(self) -> bool:
        """Whether the chat template uses a `tools` argument (Llama 3.1+ do; SmolLM2's does not)."""
        return "tools" in (self.chat_template or "")

    def apply_chat_template(
        self, messages: list[dict], add_generation_prompt: bool = True, tools: list[dict] | None = None
    ) -> str:
        """Render messages with the checkpoint's chat template (Hugging Face's jinja conventions;
        `tools` as Hugging Face passes them, for templates that render tools)."""
        if not self.chat_template:
            raise ConfigError("this model has no chat template; send a plain prompt instead")
        if self._template is None:
            env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
            env.globals["raise_exception"] = _raise
            env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
            self._template = env.from_string(self.chat_template)
        try:
            return self._template.render(
                messages=messages,
                add_generation_prompt=add_generation_prompt,
                tools=tools,
                bos_token=self.bos_token or "",
                eos_token=self.eos_token or "",
            )
        except jinja2.exceptions.TemplateError as e:
            raise ConfigError(f"chat template rejected the messages: {e}") from e


class StreamDecoder:
    """Turns a token stream into text deltas; "".join(deltas) + flush() == decode(all ids).

    A delta is held back while the pending bytes end in an incomplete UTF-8 character (the tail
    decodes to U+FFFD). Decoding a sliding window from an earlier `prefix` offset keeps leading
    spaces that some decoders strip from the first token.
    """

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = False) -> None:
        self.tokenizer = tokenizer
        self.skip = skip_special_tokens
        self.ids: list[int] = []
        self.prefix = 0  # start of the window whose text was already emitted up to `read`
        self.read = 0
        self.emitted: list[str] = []

    def _decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip)

    def push(self, token_id: int) -> str:
        """Add one token; return the new text that is now final (possibly "")."""
        self.ids.append(int(token_id))
        prefix_text = self._decode(self.ids[self.prefix : self.read])
        new_text = self._decode(self.ids[self.prefix :])
        if len(new_text) <= len(prefix_text) or new_text.endswith("\ufffd"):
            return ""
        delta = new_text[len(prefix_text) :]
        self.prefix, self.read = self.read, len(self.ids)
        self.emitted.append(delta)
        return delta

    def flush(self) -> str:
        """The rest of the text (an incomplete character at the end decodes as U+FFFD)."""
        full = self._decode(self.ids)
        done = "".join(self.emitted)
        rest = full[len(done) :] if full.startswith(done) else ""
        self.emitted.append(rest)
        self.prefix = self.read = len(self.ids)
        return rest
