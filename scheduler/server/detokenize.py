"""A request's output text as it streams: UTF-8-safe incremental detokenizing plus stop strings.

Stop strings are matched on text, so the emitted text lags the tokens by up to (longest stop string - 1)
characters: a stop string that straddles two deltas is never half-sent. On a match the text is cut before
the stop string, the token that completed it is the last token reported, and the rest is dropped.
"""

from __future__ import annotations

from specstep.engine.tokenizer import IncrementalDetokenizer, Tokenizer


class TextStream:
    def __init__(self, tokenizer: Tokenizer | None, prompt_ids: list[int], stop: list[str]) -> None:
        self._detok = IncrementalDetokenizer(tokenizer, prompt_ids) if tokenizer is not None else None
        self._stop = stop
        self._holdback = max((len(s) for s in stop), default=1) - 1
        self._pending = ""  # decoded, not yet emitted
        self.stopped = False

    def add(self, token_id: int) -> bool:
        """Feed one token; True when it completed a stop string (feed no more after that)."""
        if self._detok is None:
            return False
        new = self._detok.add([token_id])
        self._pending += new
        if self._stop and new:
            # Only a match that ends in the new text is new: earlier text was searched when it arrived.
            start = max(0, len(self._pending) - len(new) - self._holdback)
            hits = [i for i in (self._pending.find(s, start) for s in self._stop) if i >= 0]
            if hits:
                self._pending = self._pending[: min(hits)]
                self.stopped = True
        return self.stopped

    def take(self, final: bool = False) -> str:
        """Text that is safe to emit now; everything that is left when `final`."""
        if final:
            if self._detok is not None and not self.stopped:
                self._pending += self._detok.flush()
            out, self._pending = self._pending, ""
            return out
        if self.stopped:
            out, self._pending = self._pending, ""
            return out
        cut = len(self._pending) - self._holdback
        if cut <= 0:
            return ""
        out, self._pending = self._pending[:cut], self._pending[cut:]
        return out
