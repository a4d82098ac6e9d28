"""The pieces the cache classes hand work to, on their own (no engine, no tier).

``host_io.LoadedExtent``: how host-side loads grow a slot's length; ``hybrid_record``: a
persistent hybrid cache's record of its layers, what refuses a re-attach with other layers
and what a refused construction puts back.
"""

from __future__ import annotations

import json

import numpy as np
import pytest

from jax_tpusync.caches.hybrid import record as hybrid_record
from jax_tpusync.core.host_io import LoadedExtent
from jax_tpusync.core.hybrid_state import plan_groups
from jax_tpusync.persist.manifest import MANIFEST_SUFFIX


def test_lengths_grow_to_the_rows_every_layer_holds_and_never_shrink():
    extent = LoadedExtent(num_layers=2, batch=2)
    extent.record(0, np.array([0, 0]), np.array([8, 3]))
    # Layer 1 holds nothing yet: no slot grows.
    np.testing.assert_array_equal(extent.grown(np.array([0, 5])), [0, 5])
    extent.record(1, np.array([0, 0]), np.array([6, 0]))  # Slot 1: no rows, its end stays.
    np.testing.assert_array_equal(extent.grown(np.array([0, 5])), [6, 5])
    np.testing.assert_array_equal(extent.furthest(0, np.array([2, 4])), [8, 4])
    extent.reset(0, to=4)  # An admitted slot starts at its mapped prefix.
    np.testing.assert_array_equal(extent.ends[:, 0], [4, 4])
    np.testing.assert_array_equal(extent.ends[:, 1], [3, 0])
    extent.reset()
    assert not extent.ends.any()


def _plan(head_dim: int = 64):
    return plan_groups(3, 2, head_dim, [None, 8, 8])


def test_a_record_of_other_layers_is_refused_naming_the_first(tmp_path):
    options = {"tier": "file", "path": str(tmp_path)}
    path = hybrid_record.record_path(None, "kv", options)
    assert path == tmp_path / f"kv{hybrid_record.LAYERS_SUFFIX}"
    undo = hybrid_record.write_layers_record(path, _plan(), None, "kv", options)
    assert json.loads(path.read_text()) == hybrid_record.layers_record(_plan())
    manifest = tmp_path / f"kv.g0{MANIFEST_SUFFIX}"
    manifest.write_text("{}")  # A group's manifest: the record describes KV now.
    assert hybrid_record.check_layers_record(_plan(), None, "kv", options) == path
    with pytest.raises(ValueError, match=r"has layer 0 as .*'head_dim': 64.*'head_dim': 32"):
        hybrid_record.check_layers_record(_plan(32), None, "kv", options)
    # overwrite=True starts empty: nothing is compared.
    assert hybrid_record.check_layers_record(_plan(32), None, "kv", {**options, "overwrite": True})
    hybrid_record.put_back(undo)  # Neither existed before the record was written.
    assert not path.exists() and not manifest.exists()
    manifest.write_text("{}")
    with pytest.raises(ValueError, match=r"holds a cache's groups but no record of its layers"):
        hybrid_record.check_layers_record(_plan(), None, "kv", options)


def test_a_record_beside_no_group_is_replaced_and_put_back(tmp_path):
    options = {"tier": "file", "path": str(tmp_path)}
    path = hybrid_record.record_path(None, "kv", options)
    path.write_text("not json")
    # No group's manifest: the record describes no KV, so it is not compared.
    assert hybrid_record.check_layers_record(_plan(32), None, "kv", options) == path
    undo = hybrid_record.write_layers_record(path, _plan(32), None, "kv", options)
    assert json.loads(path.read_text()) == hybrid_record.layers_record(_plan(32))
    hybrid_record.put_back(undo)
    assert path.read_text() == "not json"
    assert hybrid_record.record_path(None, None, options) is None
