"""prefix.token_ids: the token ids a key hashes, refused outside [0, 2**63) instead of
wrapping onto other ids."""

from __future__ import annotations

import numpy as np
import pytest

from jax_tpusync.core import prefix

LARGEST = 2**63 - 1  # The largest id an int64 key holds.
RANGE = r"is not in \[0, 2\*\*63 - 1 = 9223372036854775807\]"


@pytest.mark.parametrize(
    "tokens",
    [
        [0, 1, LARGEST],
        np.array([0, LARGEST], np.int64),
        np.array([0, LARGEST], np.uint64),
        np.array([3, 4], np.int8),
        (5, 6),
        [np.int64(LARGEST)],
    ],
    ids=["list", "int64", "uint64", "int8", "tuple", "numpy_scalars"],
)
def test_the_edges_of_the_range_are_accepted(tokens):
    out = prefix.token_ids(tokens)
    assert out.dtype == np.int64 and out.ndim == 1
    assert out.tolist() == [int(t) for t in tokens]


@pytest.mark.parametrize(
    "tokens,bad,at",
    [
        ([0, 2**63], 2**63, 1),  # The smallest id past the range.
        ([2**63, 1], 2**63, 0),
        ([1, 2**64], 2**64, 1),  # Past uint64 too (NumPy holds it as an object).
        ([2**63 + 5, 2**63 + 5], 2**63 + 5, 0),
        (np.array([1, 2**63], np.uint64), 2**63, 1),
        (np.array([0, 2**64 - 1], np.uint64), 2**64 - 1, 1),
        ([-1, 0], -1, 0),  # The largest negative id.
        ([3, -(2**63)], -(2**63), 1),
        (np.array([4, -1], np.int64), -1, 1),
        ([-1, 2**63], -1, 0),  # Both sides out: NumPy would have made these floats.
    ],
)
def test_ids_outside_the_range_are_refused_naming_it(tokens, bad, at):
    with pytest.raises(ValueError, match=rf"token id {bad} \(tokens\[{at}\]\) {RANGE}"):
        prefix.token_ids(tokens)


@pytest.mark.parametrize(
    "tokens,message",
    [
        ([1.0, 2.0], r"1-D sequence of ints; got float64 of shape \(2,\)"),
        ([1, 2.5], r"1-D sequence of ints; got float64 of shape \(2,\)"),
        ([1, "a", 2**70], r"1-D sequence of ints; got object of shape \(3,\)"),
        ([2**70, 1.5], r"1-D sequence of ints; got object of shape \(2,\)"),
        (np.array([1.0]), r"1-D sequence of ints; got float64 of shape \(1,\)"),
        ([True, False], r"got bool of shape \(2,\)"),
        ([[1, 2]], r"got int64 of shape \(1, 2\)"),
        (["a"], r"1-D sequence of ints; got <U1"),
        ([1, "a"], r"1-D sequence of ints; got"),
    ],
)
def test_what_is_not_ints_is_refused(tokens, message):
    with pytest.raises(ValueError, match=message):
        prefix.token_ids(tokens)


def test_no_tokens_is_an_empty_int64_array():
    out = prefix.token_ids([])
    assert out.dtype == np.int64 and out.shape == (0,)


def test_the_largest_id_keys_its_own_block():
    """Keys hash the ids' int64 bytes: the largest id keys apart from its neighbour, and
    an index keys exactly what token_ids returns."""
    root = prefix.root_key("m", dict(a=1))
    top = prefix.token_ids([1, 2, 3, LARGEST])
    below = prefix.token_ids([1, 2, 3, LARGEST - 1])
    assert prefix.chain_key(root, top) != prefix.chain_key(root, below)
    index = prefix.PrefixIndex(None, 4, root)
    assert index.keys(top) == [prefix.chain_key(root, top)]
