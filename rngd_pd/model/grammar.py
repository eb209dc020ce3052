"""The token mask of a structured request: `TokenConstraint` (what the sampler calls) and the
llguidance implementation, `GrammarConstraint`.

One row of logits goes through, in order (the contract with the sampler, `Sampler.sample`): raw
logprobs, penalties and logit_bias, then this mask (tokens the grammar forbids -> -inf), then
temperature, top-k, top-p and the draw; the chosen token is then `accept`ed, and a request whose
grammar `is_terminated` finishes with reason "stop".

Costs kept off the critical path: the grammar text is compiled once per distinct constraint
(`rngd_pd.model.structured.compile_grammar`), the tokenizer's llguidance view once per tokenizer, and a
parsed matcher once per grammar (`Grammars`: an LRU of matchers that each request deep-copies). The next
mask can be computed by `prepare()` on another thread while the batch's forward runs (llguidance drops
the GIL): decode does that (`rngd_pd.engine.decode`), and `mask_into` then only applies it.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from typing import Any, Protocol

import llguidance
import numpy as np
import torch
from llguidance.numpy import fill_next_token_bitmask

from rngd_pd.errors import ConfigError, RngdPdError
from rngd_pd.model.structured import Structured

MATCHER_CACHE = 128  # parsed grammars kept per tokenizer


class TokenConstraint(Protocol):
    """A per-request constraint on the next token. Not thread-safe: one per request, driven by the
    thread that samples the request (`prepare` may run on a helper thread while that thread waits)."""

    def prepare(self) -> None:
        """Compute the mask of the next token now (may block for ~0.1-1 ms; drops the GIL)."""

    def mask_into(self, logits: torch.Tensor) -> torch.Tensor:
        """logits [vocab] -> logits with every forbidden token at -inf (a new tensor)."""

    def allows(self, token: int) -> bool:
        """Whether the grammar admits `token` next (a greedy row whose argmax it admits needs no mask)."""

    def accept(self, token: int) -> None:
        """Advance past the chosen token; RngdPdError if the grammar forbids it."""

    def is_terminated(self) -> bool:
        """True once the grammar admits nothing more (the request ends, reason "stop")."""


class GrammarConstraint:
    """TokenConstraint over an llguidance matcher."""

    def __init__(self, matcher: llguidance.LLMatcher, vocab: int, eos_token_ids: tuple[int, ...]) -> None:
        self._m = matcher
        self._mask = np.zeros((1, (vocab + 31) // 32), dtype=np.int32)
        self._ready = False
        self._eos = eos_token_ids
        self.vocab = vocab

    def prepare(self) -> None:
        if not self._ready:
            fill_next_token_bitmask(self._m, self._mask)
            self._ready = True

    def allowed(self) -> torch.Tensor:
        """bool [vocab]: the tokens the grammar admits next."""
        self.prepare()
        bits = np.unpackbits(self._mask.view(np.uint8), bitorder="little")[: self.vocab]
        return torch.from_numpy(bits.astype(np.bool_))

    def mask_into(self, logits: torch.Tensor) -> torch.Tensor:
        allowed = self.allowed()
        n = logits.shape[-1]
        if n != self.vocab:  # model rows padded past the tokenizer: the padding is never allowed
            allowed = torch.cat([allowed, torch.zeros(max(0, n - self.vocab), dtype=torch.bool)])[:n]
        return torch.where(allowed, logits, float("-inf"))

    def allows(self, token: int) -> bool:
        self.prepare()
        return 0 <= token < self.vocab and bool((int(self._mask[0, token >> 5]) >> (token & 31)) & 1)

    def accept(self, token: int) -> None:
        self._ready = False
        if self._m.is_stopped() and token in self._eos:
            return  # the end marker after a finished grammar
        if not self._m.consume_token(int(token)):
            raise RngdPdError(f"token {token} breaks the request's grammar: {self._m.get_error()}")

    def is_terminated(self) -> bool:
        return self._m.is_stopped()


class Grammars:
    """Builds constraints for one tokenizer; the matcher of each grammar is parsed once (LRU) and
    deep-copied per request. Thread-safe."""

    def __init__(self, tokenizer: Any) -> None:
        """tokenizer: rngd_pd.model.Tokenizer (its `tok` is a `tokenizers.Tokenizer`). llguidance's
        view of it is built on the first constrained request, so a tokenizer llguidance refuses
        still serves every unconstrained one."""
        self._tokenizer = tokenizer
        self._view: llguidance.LLTokenizer | None = None
        self._eos = tuple(tokenizer.eos_token_ids)
        self._lock = threading.Lock()
        self._parsed: OrderedDict[str, llguidance.LLMatcher] = OrderedDict()

    @property
    def _tok(self) -> llguidance.LLTokenizer:
        with self._lock:
            if self._view is None:
                try:
                    self._view = llguidance.LLTokenizer(self._tokenizer.tok.to_str(),
                                                        eos_token=list(self._eos) or None)
                except ValueError as e:
                    raise ConfigError(f"structured outputs need a tokenizer the grammar engine "
                                      f"(llguidance) accepts; this model's does not: {e}") from None
            return self._view

    @property
    def vocab(self) -> int:
        """The mask's size; logits rows past it are masked out."""
        return self._tok.vocab_size

    def constraint(self, structured: str | None) -> GrammarConstraint | None:
        """The constraint of a request's `structured` wire text (None: unconstrained)."""
        if not structured:
            return None
        grammar = Structured.from_json(structured).grammar()
        tok = self._tok
        with self._lock:
            base = self._parsed.get(grammar)
            if base is not None:
                self._parsed.move_to_end(grammar)
        if base is None:
            base = llguidance.LLMatcher(tok, grammar, log_level=0)
            if base.is_error():
                raise ConfigError(f"the structured output cannot be enforced: {base.get_error()}")
            with self._lock:
                self._parsed[grammar] = base
                while len(self._parsed) > MATCHER_CACHE:
                    self._parsed.popitem(last=False)
        return GrammarConstraint(base.deep_copy(), tok.vocab_size, self._eos)


_BY_TOKENIZER: dict[int, tuple[Any, Grammars]] = {}  # id -> (the tokenizer, kept alive; its Grammars)
_BY_LOCK = threading.Lock()


def grammars_for(tokenizer: Any) -> Grammars:
    """The process's one `Grammars` of a tokenizer (building the llguidance view costs ~0.3 s)."""
    key = id(tokenizer)
    with _BY_LOCK:
        if key not in _BY_TOKENIZER:
            _BY_TOKENIZER[key] = (tokenizer, Grammars(tokenizer))
        return _BY_TOKENIZER[key][1]
