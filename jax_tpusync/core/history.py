"""Each slot's token ids: the tokens whose KV the slot holds (or is about to hold).

A slot's history starts with its prompt (``admit(tokens=...)``) and grows with the tokens a
serving loop feeds it (``OffloadedKVCache.extend_tokens``). What it is for:

* ``release`` without ``tokens`` publishes the slot's full blocks under their own ids;
* a commit persists each slot's ids up to its committed length, so a restarted process has
  the token ids of the KV it re-attached to (``OffloadedKVCache.tokens``).

Ids are int64 in ``[0, 2**63)`` (see :func:`jax_tpusync.core.prefix.token_ids`).
"""

from __future__ import annotations

import base64
from collections.abc import Sequence
from typing import Any

import numpy as np

from jax_tpusync.core import prefix


class TokenHistory:
    """Per slot, a growable int64 array of token ids."""

    def __init__(self, batch: int):
        self._ids = [np.zeros(0, np.int64) for _ in range(batch)]
        self._count = [0] * batch

    def __len__(self) -> int:
        return len(self._ids)

    def count(self, slot: int) -> int:
        return self._count[slot]

    def ids(self, slot: int, n: int | None = None) -> np.ndarray:
        """int64[min(n, count)]: the first ``n`` ids of ``slot`` (all of them: None); a copy."""
        n = self._count[slot] if n is None else min(n, self._count[slot])
        return self._ids[slot][:n].copy()

    def set(self, slot: int, ids: Any) -> None:
        ids = prefix.token_ids(ids)
        self._ids[slot] = ids.copy()
        self._count[slot] = len(ids)

    def extend(self, slot: int, ids: Any) -> None:
        ids = prefix.token_ids(ids)
        n = self._count[slot]
        if n + len(ids) > len(self._ids[slot]):
            grown = np.zeros(max(2 * len(self._ids[slot]), n + len(ids), 16), np.int64)
            grown[:n] = self._ids[slot][:n]
            self._ids[slot] = grown
        self._ids[slot][n : n + len(ids)] = ids
        self._count[slot] = n + len(ids)

    def truncate(self, slot: int, n: int) -> None:
        self._count[slot] = min(self._count[slot], max(int(n), 0))

    def clear(self, slot: int) -> None:
        self.set(slot, [])

    def first_difference(self, slot: int, ids: np.ndarray) -> int | None:
        """The first position where ``ids`` and the slot's history (over their common
        length) differ; None where they agree."""
        n = min(len(ids), self._count[slot])
        differ = np.flatnonzero(self._ids[slot][:n] != ids[:n])
        return int(differ[0]) if len(differ) else None

    # -- persistence ------------------------------------------------------------------------

    def to_json(self, lengths: Sequence[int]) -> list[str]:
        """Each slot's first ``lengths[b]`` ids (fewer if it has fewer), as base64 of
        little-endian int64: the manifest's ``"tokens"``."""
        out = []
        for b, n in enumerate(lengths):
            raw = self.ids(b, int(n)).astype("<i8").tobytes()
            out.append(base64.b64encode(raw).decode("ascii"))
        return out

    def restore(self, encoded: Sequence[str]) -> None:
        """The slots' ids from :meth:`to_json`'s strings (already validated)."""
        for b, text in enumerate(encoded):
            self.set(b, decode_ids(text))


def decode_ids(text: Any) -> np.ndarray:
    """int64 ids from one slot's base64 string; raises ValueError naming what is wrong."""
    if not isinstance(text, str):
        raise ValueError(f"token ids must be a base64 string, not {type(text).__name__}")
    try:
        raw = base64.b64decode(text.encode("ascii"), validate=True)
    except (ValueError, UnicodeEncodeError) as e:
        raise ValueError(f"token ids are not base64: {e}") from None
    if len(raw) % 8:
        raise ValueError(f"token ids hold {len(raw)} bytes, not a multiple of 8")
    ids = np.frombuffer(raw, "<i8").astype(np.int64)
    if (ids < 0).any():
        raise ValueError("token ids include a negative id")
    return ids
