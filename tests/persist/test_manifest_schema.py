"""Manifest JSON of the wrong shape, and shared block headers of the wrong shape: each is the
module's named error naming the file and what is wrong, never an AttributeError, TypeError
or KeyError. No cache is opened: the readers are fed files directly."""

from __future__ import annotations

import copy
import json
import struct

import numpy as np
import pytest

from jax_tpusync.core import prefix, shared_blocks
from jax_tpusync.persist import commit as persistence
from jax_tpusync.persist import manifest

LAYERS, BATCH, MAX_LEN, KV_HEADS, HEAD_DIM = 2, 2, 16, 1, 4
BLOCK_TOKENS, NUM_BLOCKS = 4, 8
ROOT = prefix.root_key("m", dict(a=1))
TOKENS = [7, 8, 9, 2**63 - 1]  # The largest token id a key hashes.
KEY = prefix.chain_key(ROOT, np.asarray(TOKENS, np.int64))


def geometry() -> manifest.Geometry:
    return manifest.Geometry.of(
        LAYERS,
        BATCH,
        MAX_LEN,
        KV_HEADS,
        HEAD_DIM,
        "float32",
        "model",
        block_tokens=BLOCK_TOKENS,
        num_blocks=NUM_BLOCKS,
    )


def good_manifest() -> dict:
    """A valid commit: sequence 0 holds 5 rows in blocks 0 and 1, sequence 1 is free, block
    3 is an indexed (cached) prefix block."""
    entry = prefix.Entry(KEY, None, np.asarray(TOKENS, np.int64), 3, sums=[1, 2, 3, 4])
    sums = [[] for _ in range(LAYERS * 2 * BATCH)]
    for layer in range(LAYERS):
        for kv in range(2):
            sums[(layer * 2 + kv) * BATCH] = [0xABC]  # One 8-row chunk of sequence 0.
    return manifest.manifest_json(
        geometry=geometry(),
        tier="file",
        data="kv.tpusync",
        commit=3,
        session="closed",
        timestamp=0.0,
        time_text="",
        lengths=[5, 0],
        tables=[[0, 1, -1, -1], [-1, -1, -1, -1]],
        capacity=[8, 0],
        chunk_rows=8,
        sums=sums,
        prefix_json=manifest.prefix_section(ROOT, [], [0, 0], [manifest.entry_json(entry, LAYERS)]),
    )


@pytest.fixture
def tier(tmp_path):
    """A file tier's data (empty: prepare() only reads the manifest) and manifest paths."""
    data = tmp_path / "kv.tpusync"
    data.write_bytes(b"")
    return data, tmp_path / f"kv{manifest.MANIFEST_SUFFIX}"


def prepare(tmp_path):
    return persistence.Persistence.prepare(
        tier="file",
        path=tmp_path,
        shm_name=None,
        file_name="kv",
        geometry=geometry(),
        overwrite=False,
    )


def test_the_good_manifest_is_read(tmp_path, tier):
    _, path = tier
    path.write_text(json.dumps(good_manifest()))
    p = prepare(tmp_path)
    restored = p._restored
    assert restored["commit"] == 3
    assert restored["lengths"].tolist() == [5, 0]
    assert restored["entries"][0]["tokens"].tolist() == TOKENS
    assert restored["entries"][0]["sums"] == [1, 2, 3, 4]
    assert restored["sums"][0] == [0xABC]


def _set(*where_and_value):
    *where, value = where_and_value

    def edit(m):
        target = m
        for k in where[:-1]:
            target = target[k]
        target[where[-1]] = value
        return m

    return edit


def _replace(value):
    return lambda m: value


# Each edit of the good manifest and the message naming what is wrong.
WRONG_SHAPES = {
    "top_level_list": (_replace([1, 2]), r"it holds a list, not an object"),
    "top_level_null": (_replace(None), r"it holds null, not an object"),
    "top_level_string": (_replace("manifest"), r"it holds a string \('manifest'\), not an object"),
    "format_version_string": (_set("format_version", "2"), r"format_version '2'; this build reads"),
    "format_version_bool": (_set("format_version", True), r"format_version True; this build reads"),
    "geometry_string": (_set("geometry", "abc"), r"geometry is a string \('abc'\), not an object"),
    "geometry_list": (_set("geometry", [1, 2]), r"geometry is a list, not an object"),
    "geometry_null": (_set("geometry", None), r"geometry is null, not an object"),
    "commit_string": (_set("commit", "3"), r"commit is '3', not an int >= 0"),
    "commit_bool": (_set("commit", True), r"commit is True, not an int >= 0"),
    "lengths_string": (
        _set("lengths", "abc"),
        r"lengths must have shape \[2\]; lengths is a string \('abc'\), not a list of 2",
    ),
    "lengths_object": (
        _set("lengths", {"0": 5}),
        r"lengths must have shape \[2\]; lengths is an object, not a list of 2",
    ),
    "lengths_huge": (_set("lengths", 0, 2**64), r"lengths\[0\] is 18446744073709551616, not an int"),
    "block_tables_flat": (
        _set("block_tables", [0, 1]),
        r"block_tables must have shape \[2, 4\]; block_tables\[0\] is an int \(0\), not a list",
    ),
    "capacity_null": (_set("capacity", None), r"capacity must have shape \[2\]; capacity is null"),
    "checksum_list": (_set("checksum", [8]), r"checksum is a list, not an object"),
    "checksum_string": (_set("checksum", "xxh3_64"), r"checksum is a string \('xxh3_64'\)"),
    "checksums_string": (_set("checksums", "abc"), r"checksums is a string \('abc'\), not a list"),
    "checksums_object": (_set("checksums", {}), r"checksums is an object, not a list"),
    "checksums_layer_short": (_set("checksums", [[]]), r"checksums has 1 entries, not 2"),
    "checksums_kv_string": (_set("checksums", 0, "KV"), r"checksums\[0\] is a string \('KV'\)"),
    "checksums_sequence_string": (
        _set("checksums", 1, 0, 0, "0000000000000abc"),
        r"checksums\[1\]\[0\]\[0\] is a string \('0000000000000abc'\), not a list",
    ),
    "checksum_digest_int": (
        _set("checksums", 0, 0, 0, [2748]),
        r"checksums\[0\]\[0\]\[0\]\[0\] is 2748, not a 64-bit digest \(16 hex digits\)",
    ),
    "checksum_digest_spaced": (
        _set("checksums", 0, 0, 0, ["00 00 00 00 0abc"]),
        r"checksums\[0\]\[0\]\[0\]\[0\] is '00 00 00 00 0abc', not a 64-bit digest",
    ),
    "session_int": (_set("session", 5), r"session is an int \(5\), not a string"),
    "prefix_list": (_set("prefix", []), r"prefix is a list, not an object"),
    "prefix_string": (_set("prefix", "none"), r"prefix is a string \('none'\), not an object"),
    "prefix_root_list": (_set("prefix", "root", [1]), r"prefix.root is \[1\], not a 128-bit"),
    "prefix_foreign_roots_object": (
        _set("prefix", "foreign_roots", {}),
        r"prefix.foreign_roots is an object, not a list",
    ),
    "prefix_shared_string": (
        _set("prefix", "shared", "00"),
        r"prefix.shared must have shape \[2\]; prefix.shared is a string",
    ),
    "prefix_shared_past_the_table": (
        _set("prefix", "shared", [5, 0]),
        r"prefix.shared\[0\] = 5 is not in \[0, 4\]",
    ),
    "prefix_entries_object": (
        _set("prefix", "entries", {"0": {}}),
        r"prefix.entries is an object, not a list",
    ),
    "prefix_entry_int": (_set("prefix", "entries", 0, 5), r"prefix.entries\[0\] is an int \(5\)"),
    "prefix_entry_list": (
        _set("prefix", "entries", 0, [1, 2, 3]),
        r"prefix.entries\[0\] is a list, not an object",
    ),
    "prefix_entry_tokens_string": (
        _set("prefix", "entries", 0, "tokens", "abcd"),
        r"prefix.entries\[0\].tokens must have shape \[4\]; prefix.entries\[0\].tokens is a "
        r"string",
    ),
    "prefix_entry_token_past_int64": (
        _set("prefix", "entries", 0, "tokens", 3, 2**63),
        r"prefix.entries\[0\].tokens\[3\] is 9223372036854775808, not an int in "
        r"\[0, 9223372036854775808\)",
    ),
    "prefix_entry_token_negative": (
        _set("prefix", "entries", 0, "tokens", 0, -1),
        r"prefix.entries\[0\].tokens\[0\] is -1, not an int in \[0, ",
    ),
    "prefix_entry_parent_int": (
        _set("prefix", "entries", 0, "parent", 0),
        r"prefix.entries\[0\].parent is 0, not a 128-bit digest",
    ),
    "prefix_entry_block_string": (
        _set("prefix", "entries", 0, "block", "3"),
        r"prefix.entries\[0\].block = '3' is not a block id",
    ),
    "prefix_entry_checksums_string": (
        _set("prefix", "entries", 0, "checksums", "abc"),
        r"prefix.entries\[0\].checksums are not \[layer\]\[K\|V\] hex digests "
        r"\(prefix.entries\[0\].checksums is a string",
    ),
    "prefix_entry_checksums_object": (
        _set("prefix", "entries", 0, "checksums", 0, {"K": "0" * 16, "V": "0" * 16}),
        r"prefix.entries\[0\].checksums\[0\] is an object, not a list",
    ),
    "prefix_entry_checksum_int": (
        _set("prefix", "entries", 0, "checksums", 1, 1, 4),
        r"prefix.entries\[0\].checksums\[1\]\[1\] is 4, not a 64-bit digest",
    ),
}


@pytest.mark.parametrize("case", sorted(WRONG_SHAPES))
def test_a_manifest_of_the_wrong_shape_is_named(tmp_path, tier, case):
    edit, message = WRONG_SHAPES[case]
    _, path = tier
    path.write_text(json.dumps(edit(copy.deepcopy(good_manifest()))))
    with pytest.raises(persistence.MissingManifestError, match=message) as info:
        prepare(tmp_path)
    assert str(info.value).startswith(f"cannot use manifest {path}: ")
    assert "overwrite=True" in str(info.value)
    # Also through the functions that other modules call.
    with pytest.raises(manifest.MissingManifestError, match=message):
        m = manifest.read_manifest(path)
        manifest.checked_commit(m, manifest.Geometry.from_json(m["geometry"]), path)


@pytest.mark.parametrize(
    "text,message",
    [
        ("", r"Expecting value"),
        ("{", r"Expecting property name"),
        ("[" * 100_000 + "]" * 100_000, r"cannot use manifest"),  # Nested past the recursion limit.
        ('{"format": "jax_tpusync.kv_manifest", "format_version": 2}', r"no 'geometry'"),
    ],
    ids=["empty", "truncated", "deep", "no_geometry"],
)
def test_unreadable_json_is_named(tmp_path, tier, text, message):
    _, path = tier
    path.write_text(text)
    with pytest.raises(persistence.MissingManifestError, match=message) as info:
        prepare(tmp_path)
    assert f"cannot use manifest {path}: " in str(info.value)


def test_non_utf8_bytes_are_named(tmp_path, tier):
    _, path = tier
    path.write_bytes(b"\xff\xfe{}")
    with pytest.raises(persistence.MissingManifestError, match=f"cannot use manifest {path}: "):
        prepare(tmp_path)


@pytest.mark.parametrize(
    "field,value",
    [("batch", "2"), ("num_layers", [2]), ("dtype", {"name": "float32"}), ("block_tokens", None)],
)
def test_a_geometry_field_of_the_wrong_type_is_a_layout_mismatch(tmp_path, tier, field, value):
    data, path = tier
    m = good_manifest()
    m["geometry"][field] = value
    path.write_text(json.dumps(m))
    with pytest.raises(persistence.LayoutMismatchError, match=f"{field}: the tier holds") as info:
        prepare(tmp_path)
    assert f"the KV in {data} does not belong to this cache" in str(info.value)


def test_the_commit_check_refuses_a_geometry_it_cannot_use(tmp_path):
    """A geometry read from a manifest whose sizes are not positive ints never reaches
    arithmetic (the commit check is also called with geometries the cache did not make)."""
    for field, value in (("batch", "2"), ("max_len", 0), ("num_layers", True)):
        held = manifest.Geometry.from_json({**geometry().to_json(), field: value})
        with pytest.raises(
            manifest.MissingManifestError, match=rf"geometry.{field} is {value!r}, not a positive int"
        ):
            manifest.checked_commit(good_manifest(), held, tmp_path / "m.json")


def test_geometry_from_json_refuses_a_non_object():
    with pytest.raises(ValueError, match=r"geometry is a list, not an object"):
        manifest.Geometry.from_json([1, 2])


def test_persistence_keeps_the_schema_names():
    for name in (
        "PersistenceError",
        "LayoutMismatchError",
        "MissingManifestError",
        "ChecksumMismatchError",
        "CommitError",
        "Geometry",
        "LAYOUT_VERSION",
        "MANIFEST_SUFFIX",
        "MANIFEST_VERSION",
        "SHM_DIRECTORY",
    ):
        assert getattr(persistence, name) is getattr(manifest, name), name
        assert name in persistence.__all__
    assert issubclass(persistence.ChecksumMismatchError, persistence.PersistenceError)


# -- shared block headers --------------------------------------------------------------------


def _directory(tmp_path):
    return shared_blocks.SharedBlockDirectory(
        tmp_path / "blocks", root=ROOT, num_layers=1, block_tokens=BLOCK_TOKENS, block_bytes=8
    )


def _write_block(d, header_json: bytes, payload: bytes = bytes(16)):
    path = d.file_of(KEY)
    path.write_bytes(
        struct.pack("<8sII", shared_blocks.MAGIC, shared_blocks.FORMAT_VERSION, len(header_json))
        + header_json
        + payload
    )
    return path


def test_a_published_block_reads_back(tmp_path):
    d = _directory(tmp_path)
    payload = np.arange(16, dtype=np.uint8)
    assert d.publish(KEY, None, np.asarray(TOKENS), payload)
    np.testing.assert_array_equal(d.load(KEY, None, np.asarray(TOKENS)), payload)


def _good_header(d) -> dict:
    return d._header(KEY, None, np.asarray(TOKENS), 0)


HEADER_SHAPES = {
    "list": (lambda h: [1, 2, 3], r"the header is list, not an object"),
    "string": (lambda h: "header", r"the header is str, not an object"),
    "null": (lambda h: None, r"the header is NoneType, not an object"),
    "key_int": (lambda h: {**h, "key": 5}, r"header field 'key' is 5, not a string"),
    "parent_list": (lambda h: {**h, "parent": []}, r"header field 'parent' is \[\], not a string or null"),
    "num_layers_string": (
        lambda h: {**h, "num_layers": "1"},
        r"header field 'num_layers' is '1', not an int",
    ),
    "tokens_string": (
        lambda h: {**h, "tokens": "7 8 9"},
        r"header field 'tokens' is '7 8 9', not a list of ints",
    ),
    "tokens_of_floats": (
        lambda h: {**h, "tokens": [7.0, 8, 9, 10]},
        r"header field 'tokens' is \[7.0, 8, 9, 10\], not a list of ints",
    ),
    "checksum_missing": (
        lambda h: {k: v for k, v in h.items() if k != "xxh3_64"},
        r"header field 'xxh3_64' is None, not an int",
    ),
}


@pytest.mark.parametrize("case", sorted(HEADER_SHAPES))
def test_a_shared_block_header_of_the_wrong_shape_is_named(tmp_path, case):
    d = _directory(tmp_path)
    edit, message = HEADER_SHAPES[case]
    path = _write_block(d, json.dumps(edit(_good_header(d))).encode())
    with pytest.raises(shared_blocks.SharedBlockError, match=message) as info:
        d.load(KEY, None, np.asarray(TOKENS))
    assert str(info.value).startswith(f"shared block {path}: unreadable header (")


def test_a_shared_block_header_past_the_file_end_is_named(tmp_path):
    d = _directory(tmp_path)
    path = d.file_of(KEY)
    header = json.dumps(_good_header(d)).encode()
    path.write_bytes(
        struct.pack("<8sII", shared_blocks.MAGIC, shared_blocks.FORMAT_VERSION, len(header) + 17)
        + header
    )
    with pytest.raises(
        shared_blocks.SharedBlockError,
        match=rf"shared block {path}: unreadable header \(a header of {len(header) + 17} bytes "
        rf"runs past the end of the file \({16 + len(header)} bytes\)\)",
    ):
        d.load(KEY, None, np.asarray(TOKENS))


def test_a_shared_block_header_nested_past_the_recursion_limit_is_named(tmp_path):
    d = _directory(tmp_path)
    path = _write_block(d, b"[" * 100_000 + b"]" * 100_000)
    with pytest.raises(shared_blocks.SharedBlockError, match=f"shared block {path}: unreadable"):
        d.load(KEY, None, np.asarray(TOKENS))
