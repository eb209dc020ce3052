"""Logprob rows (`rngd_pd.model.params.TokenLogprobs`: the chosen token, then its top-k) in OpenAI's
two shapes: chat's `logprobs.content` entries, and the legacy completions object of parallel lists.

Each token is shown as the tokenizer decodes it alone (vLLM does the same); chat adds its UTF-8
bytes, so a client can join the pieces of a character split across tokens. The values are the
model's raw log-softmax (vLLM's default `raw_logprobs`): before temperature, penalties and biases.
"""

from __future__ import annotations

from collections.abc import Sequence

from rngd_pd.frontend.prompts import TokenizerLike
from rngd_pd.frontend.schemas import ChatLogprobs, ChatTokenLogprob, CompletionLogprobs, TopLogprob
from rngd_pd.model.params import TokenLogprobs


class TokenText:
    """Token id -> its text alone, cached (a request shows the same tokens over and over)."""

    def __init__(self, tokenizer: TokenizerLike) -> None:
        self.tokenizer = tokenizer
        self._cache: dict[int, str] = {}

    def __call__(self, token: int) -> str:
        text = self._cache.get(token)
        if text is None:
            text = self._cache[token] = self.tokenizer.decode([token])
        return text


def chat_logprobs(rows: Sequence[TokenLogprobs], top: int, text: TokenText) -> ChatLogprobs:
    """Chat's `logprobs`: one content entry per token with its `top` alternatives."""

    def entry(token: int, logprob: float) -> TopLogprob:
        s = text(token)
        return TopLogprob(token=s, logprob=logprob, bytes=list(s.encode("utf-8")))

    content = []
    for row in rows:
        chosen = entry(row.token, row.logprob)
        alternatives = [entry(t, v) for t, v in row.top[:top]]
        content.append(ChatTokenLogprob(**chosen.model_dump(), top_logprobs=alternatives))
    return ChatLogprobs(content=content)


class CompletionLogprobBuilder:
    """The completions `logprobs` object of one choice, built piece by piece: `text_offset` goes on
    from where the previous piece (a streamed chunk, the echoed prompt) ended."""

    def __init__(self, text: TokenText) -> None:
        self.text = text
        self.offset = 0

    def prompt(self, ids: Sequence[int], rows: Sequence[TokenLogprobs] | None) -> CompletionLogprobs:
        """The echoed prompt: its first token has no logprob (nothing precedes it)."""
        out = CompletionLogprobs()
        self._add(out, ids[0], None, None)
        for token, row in zip(ids[1:], rows or [None] * (len(ids) - 1), strict=True):
            self._add(out, token, None if row is None else row.logprob, row)
        return out

    def tokens(self, rows: Sequence[TokenLogprobs]) -> CompletionLogprobs:
        out = CompletionLogprobs()
        for row in rows:
            self._add(out, row.token, row.logprob, row)
        return out

    def _add(self, out: CompletionLogprobs, token: int, logprob: float | None,
             row: TokenLogprobs | None) -> None:
        s = self.text(token)
        out.text_offset.append(self.offset)
        out.tokens.append(s)
        out.token_logprobs.append(logprob)
        # vLLM's dict: the top k and the chosen token (a token shown alike by two ids keeps the first)
        top = None if row is None else {self.text(t): v for t, v in ((row.token, row.logprob), *row.top)}
        if top is not None and row is not None:
            top = dict(sorted(top.items(), key=lambda kv: -kv[1]))
        out.top_logprobs.append(top)
        self.offset += len(s)


def merged(parts: Sequence[CompletionLogprobs]) -> CompletionLogprobs:
    """Several pieces' logprobs as one (a non-streamed answer: the echoed prompt, then the reply)."""
    out = CompletionLogprobs()
    for p in parts:
        out.text_offset += p.text_offset
        out.token_logprobs += p.token_logprobs
        out.tokens += p.tokens
        out.top_logprobs += p.top_logprobs
    return out
