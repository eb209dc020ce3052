"""Stop-string matching over streamed text (`StopChecker`).

Torch-free: the decode engine and the OpenAI front end both cut text with it, so they agree on where a
stop string matched; `rngd_pd.model.sampling` re-exports it.
"""

from __future__ import annotations


class StopChecker:
    """Finds stop strings in streamed text; the text it releases never contains (part of) one.

    push(delta) returns (text safe to emit, stopped). Once stopped, the returned text ends just
    before the stop string and later pushes return ("", True). flush() returns the held-back tail
    when the request ends for another reason (EOS, length).
    """

    def __init__(self, stop: tuple[str, ...]) -> None:
        self.stop = tuple(stop)
        self._pending = ""
        self.stopped = False

    def push(self, delta: str) -> tuple[str, bool]:
        if self.stopped:
            return "", True
        if not self.stop:
            return delta, False
        buf = self._pending + delta
        idx = first_stop(buf, self.stop)
        if idx >= 0:
            self.stopped, self._pending = True, ""
            return buf[:idx], True
        hold = held_suffix_len(buf, self.stop)
        self._pending = buf[len(buf) - hold :] if hold else ""
        return buf[: len(buf) - hold], False

    def flush(self) -> str:
        out, self._pending = ("" if self.stopped else self._pending), ""
        return out


def held_suffix_len(text: str, stop: tuple[str, ...]) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of some stop string: what a
    stream must hold back because the next token may complete a stop string there."""
    best = 0
    for s in stop:
        for n in range(min(len(s) - 1, len(text)), best, -1):
            if text.endswith(s[:n]):
                best = n
                break
    return best


def first_stop(text: str, stop: tuple[str, ...], start: int = 0) -> int:
    """Index of the earliest occurrence of any stop string in `text[start:]`, or -1."""
    hits = [i for i in (text.find(s, start) for s in stop if s) if i >= 0]
    return min(hits, default=-1)
