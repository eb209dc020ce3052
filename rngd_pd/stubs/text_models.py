"""`preprocess` (text -> ids) and `postprocess` (ids -> text, streaming-safe), and why pd sends them
`context_ids` (defined in rngd_pd.wire.tensors).

Why `context_ids`: postprocess runs once per streamed response and keeps no state (several instances,
no correlation between calls), yet a token alone cannot always be turned into text - a character can
span tokens (byte-level BPE), and some decoders drop a leading space at the start of a decode. So pd
(and colocated) send, with each response's ids, the up-to-8 ids generated before them, and

    delta = safe(decode(context + ids)) - safe(decode(context))

where `safe` drops a trailing incomplete character (U+FFFD) except on the final response. The deltas
telescope: their concatenation equals decode(all generated ids) exactly, never with broken UTF-8.

Stop strings (the request's `stop`, which pd echoes to postprocess): as in vLLM and the OpenAI API the text
never contains one. Before the final response each side also drops the tail that could still become
a stop string (`held_suffix_len`); the final response cuts the text at the first stop string after
what was already released. pd sends enough context for that (`chunks.context_len`): the
held-back tail is at most the longest stop string less one character, each at most 4 tokens.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from rngd_pd import errors
from rngd_pd.model.checkpoint import load_tokenizer as load
from rngd_pd.model.stopping import first_stop, held_suffix_len
from rngd_pd.stubs import pbutils
from rngd_pd.stubs.serving import TextParams, model_params
from rngd_pd.wire import tensors as T

CONTEXT_IDS = T.CONTEXT_IDS
POSTPROCESS_SPEC = T.POSTPROCESS


def spec_for(name: str) -> T.ModelSpec:
    """The spec a model of the repository follows (rngd_pd.wire.tensors)."""
    return T.model_spec(name)


def load_tokenizer(path: str | None) -> Any:
    """The checkpoint's tokenizer without its weights (embedded model when path is None or empty)."""
    return load(path or None)[1]


def _safe(text: str) -> str:
    return text[:-1] if text.endswith("\ufffd") else text


def text_delta(tokenizer: Any, context: Sequence[int], ids: Sequence[int], final: bool,
               stop: Sequence[str] = ()) -> str:
    """The text `ids` add after `context` (see the module docstring); flushes on `final`."""
    stop = tuple(s for s in stop if s)
    before = _safe(tokenizer.decode(list(context))) if context else ""
    before = before[:len(before) - held_suffix_len(before, stop)]  # what earlier deltas released
    after = tokenizer.decode([*context, *ids])
    if not final:
        after = _safe(after)
        after = after[:len(after) - held_suffix_len(after, stop)]
    elif stop and (cut := first_stop(after, stop, len(before))) >= 0:
        after = after[:cut]
    if after.startswith(before):
        return after[len(before):]
    common = 0  # a decoder that rewrote the context's tail: emit what differs after the shared prefix
    while common < min(len(before), len(after)) and before[common] == after[common]:
        common += 1
    return after[common:]


class _TokenizerModel:
    """What pre- and postprocess share: the checkpoint's tokenizer, one response per request."""

    def initialize(self, args: dict) -> None:
        self.tokenizer = load_tokenizer(model_params(TextParams, args).model_path)

    def execute(self, requests: list) -> list:
        return [self._one(r) for r in requests]

    def _one(self, request: Any) -> Any:
        raise NotImplementedError


class PreprocessModel(_TokenizerModel):
    """Triton adapter: text_input (+ apply_chat_template) -> input_ids."""

    def _one(self, request: Any) -> Any:
        try:
            text = pbutils.input_scalar(request, T.TEXT_INPUT)
            if text is None or text == "":
                raise errors.ConfigError(f"input {T.TEXT_INPUT!r} is required and must not be empty")
            templated = bool(pbutils.input_scalar(request, T.APPLY_CHAT_TEMPLATE, False))
            if templated:
                text = self.tokenizer.apply_chat_template([{"role": "user", "content": text}])
            ids = self.tokenizer.encode(text, add_special_tokens=not templated)  # a template has its BOS
            if not ids:
                raise errors.ConfigError("the prompt encodes to no tokens")
        except Exception as exc:
            return pbutils.error_response(exc)
        return pbutils.make_response(T.PREPROCESS, {T.INPUT_IDS: ids, T.ERRORS_IN_BAND: [True]},
                                     pbutils.requested_outputs(request))


class PostprocessModel(_TokenizerModel):
    """Triton adapter: output_ids + context_ids + finish_reason -> text_output (and the ids, reason)."""

    def _one(self, request: Any) -> Any:
        try:
            failed = pbutils.input_scalar(request, T.ERROR, "")
            if failed:  # pd's error, in band (rngd_pd.wire.tensors.ERROR): the request's final answer
                return pbutils.error_response(errors.from_wire(failed))
            ids = _ints(pbutils.input_array(request, T.OUTPUT_IDS))
            context = _ints(pbutils.input_array(request, CONTEXT_IDS))
            reason = pbutils.input_scalar(request, T.FINISH_REASON, "") or ""
            stop = pbutils.input_strings(request, T.STOP)
            text = text_delta(self.tokenizer, context, ids, final=bool(reason), stop=stop)
        except Exception as exc:
            return pbutils.error_response(exc)
        passed = {t.name: _values(pbutils.input_array(request, t.name), t.numpy_dtype)
                  for t in T.LOGPROB_OUTPUTS}  # pd's, unchanged
        passed[T.INDEX] = passed[T.INDEX] or [0]
        return pbutils.make_response(POSTPROCESS_SPEC, {T.TEXT_OUTPUT: text, T.OUTPUT_IDS: ids,
                                                        T.FINISH_REASON: reason, **passed},
                                     pbutils.requested_outputs(request))


def _ints(array: Any) -> list[int]:
    return [] if array is None else [int(i) for i in array.reshape(-1)]


def _values(array: Any, dtype: Any) -> list:
    return [] if array is None else array.reshape(-1).astype(dtype).tolist()
