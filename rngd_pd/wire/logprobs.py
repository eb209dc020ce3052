"""Logprobs as tensors: the one encoder and decoder every hop uses (prefill, decode, pd, postprocess,
the front end).

A response's logprobs are rows of equal width 1 + k (k = the request's `logprobs`, or its
`prompt_logprobs` for the prompt): the chosen (or prompt) token first, then its top-k alternatives by
descending logprob. Ids and values travel as two flat tensors (`rngd_pd.wire.tensors`:
TOKEN_LOGPROB_IDS / TOKEN_LOGPROBS, PROMPT_LOGPROB_IDS / PROMPT_LOGPROB_VALUES); the width is the
number of elements over the number of rows, which the receiver knows (one row per output id, one per
prompt token after the first). Empty tensors: none were asked for.
"""

from __future__ import annotations

from collections.abc import Sequence

from rngd_pd.errors import ConfigError
from rngd_pd.model.params import TokenLogprobs


def flatten(rows: Sequence[TokenLogprobs | None]) -> tuple[list[int], list[float]]:
    """Rows -> (ids, values), flat; empty when there are no rows or none has logprobs."""
    if not rows or any(r is None for r in rows):
        return [], []
    ids = [i for r in rows for i in r.ids]  # type: ignore[union-attr]
    values = [v for r in rows for v in r.values]  # type: ignore[union-attr]
    return ids, values


def unflatten(ids: Sequence[int], values: Sequence[float], rows: int) -> list[TokenLogprobs] | None:
    """(ids, values) of `rows` rows -> the rows; None when the tensors are empty (none asked for)."""
    if not ids and not values:
        return None
    if rows <= 0 or len(ids) != len(values) or len(ids) % rows:
        raise ConfigError(f"logprob tensors of {len(ids)} ids and {len(values)} values do not make "
                          f"{rows} rows of equal width")
    width = len(ids) // rows
    return [TokenLogprobs(tuple(int(i) for i in ids[r * width:(r + 1) * width]),
                          tuple(float(v) for v in values[r * width:(r + 1) * width]))
            for r in range(rows)]
