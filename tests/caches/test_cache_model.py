"""A model-based test of the host calls: admit, release, load and commit, refusals mixed in,
against a plain model of every slot's tokens, on one device and on a 2x2 mesh.

Every K/V row is a function of its token id, position, layer and head, so a prefix block
mapped from an earlier sequence holds exactly the rows the model expects. After every call
(refused or not) the state the caller holds keeps working: its lengths equal the model's and
every active slot's KV reads back as the model says.
"""

from __future__ import annotations

import collections

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

import jax_tpusync as tps

LAYERS, BATCH, MAX_LEN, HEADS, DIM, BLOCK = 2, 4, 32, 2, 4, 4
NUM_BLOCKS = 20  # Fewer than 4 slots x 8 blocks: admissions compete and get refused.
PREFIXES = [list(range(100, 112)), list(range(200, 212)), list(range(100, 104)) + [7] * 8]


def rows_of(tokens, start: int, layers=LAYERS) -> np.ndarray:
    """[LAYERS, n, HEADS, DIM] rows of ``tokens`` placed from position ``start``."""
    t = np.asarray(tokens, np.float32)[None, :, None, None]
    pos = np.arange(start, start + len(tokens), dtype=np.float32)[None, :, None, None]
    layer = np.arange(layers, dtype=np.float32)[:, None, None, None]
    head = np.arange(HEADS, dtype=np.float32)[None, None, :, None]
    return t + pos / 64 + layer * 1000 + head / 8 + np.arange(DIM, dtype=np.float32) / 256


class HostCalls(RuleBasedStateMachine):
    """Subclasses set ``mesh`` (None: one device)."""

    mesh = None
    seen: collections.Counter = collections.Counter()  # What the runs exercised.

    @initialize()
    def open(self):
        args = dict(
            num_layers=LAYERS,
            batch=BATCH,
            max_len=MAX_LEN,
            num_kv_heads=HEADS,
            head_dim=DIM,
            dtype=jnp.float32,
            block_tokens=BLOCK,
            num_blocks=NUM_BLOCKS,
            staging_bytes=1 << 20,
        )
        if self.mesh is not None:
            args.update(mesh=self.mesh, kv_heads_axis="model", batch_axis="data")
        self.cache = tps.kv_cache(**args)
        self.state = self.cache.init(admit=False)
        self.tokens: dict[int, list[int]] = {}  # Active slots: the tokens whose KV they hold.
        self.capacity: dict[int, int] = {}
        self.prompt: dict[int, list[int]] = {}

    def teardown(self):
        if hasattr(self, "cache"):
            self.cache.close()

    def lengths(self) -> np.ndarray:
        if self.mesh is not None:
            return self.cache.lengths(self.state)
        return np.asarray(self.state.lengths)

    @rule(
        slot=st.one_of(st.integers(0, BATCH - 1), st.integers(-1, BATCH)),
        prefix=st.sampled_from(PREFIXES),
        cut=st.one_of(st.just(12), st.integers(0, 12)),
        max_tokens=st.one_of(st.just(16), st.integers(1, MAX_LEN + 1)),
    )
    def admit(self, slot, prefix, cut, max_tokens):
        prompt = prefix[: max(cut, 1)]
        before = self.lengths().copy()
        try:
            self.state, cached = self.cache.admit(
                self.state, slot, tokens=prompt, max_tokens=max_tokens
            )
        except ValueError as e:
            refused = (
                not 0 <= slot < BATCH
                or slot in self.tokens
                or not 1 <= max_tokens <= MAX_LEN
                or len(prompt) > max_tokens
            )
            np.testing.assert_array_equal(self.lengths(), before)
            if not refused:  # The only other refusal: too few blocks.
                assert "KV blocks" in str(e), e
            HostCalls.seen["refused admits"] += 1
            return
        assert 0 <= slot < BATCH and slot not in self.tokens
        assert cached % BLOCK == 0 and cached <= max(len(prompt) - 1, 0)
        HostCalls.seen["prefix hits" if cached else "admits"] += 1
        self.tokens[slot] = prompt[:cached]
        self.capacity[slot] = max_tokens
        self.prompt[slot] = prompt[cached:]  # Prefilled by the slot's next load.

    @rule(slot=st.integers(0, BATCH - 1), extra=st.lists(st.integers(0, 50), max_size=10))
    def load(self, slot, extra):
        if slot not in self.tokens:
            return
        held = self.tokens[slot]
        new = (self.prompt.pop(slot, []) + extra)[: self.capacity[slot] - len(held)]
        if not new:
            return
        rows = rows_of(new, len(held))
        k = np.zeros((LAYERS, BATCH, len(new), HEADS, DIM), np.float32)
        k[:, slot] = rows
        counts = [len(new) if b == slot else 0 for b in range(BATCH)]
        starts = [len(self.tokens.get(b, [])) for b in range(BATCH)]
        for layer in range(LAYERS):
            self.state = self.cache.load(
                self.state, layer, k[layer], -k[layer], start=starts, lengths=counts
            )
        self.tokens[slot] = held + list(new)

    @rule(
        slot=st.one_of(st.integers(0, BATCH - 1), st.integers(-1, BATCH)),
        with_tokens=st.one_of(st.just(True), st.booleans()),
        short=st.one_of(st.just(False), st.booleans()),
    )
    def release(self, slot, with_tokens, short):
        held = self.tokens.get(slot, [])
        tokens = None
        if with_tokens:
            tokens = held[:-1] if short and held else held
        before = self.lengths().copy()
        try:
            self.state = self.cache.release(self.state, slot, tokens=tokens)
        except ValueError:
            assert slot not in self.tokens or (with_tokens and short and held)
            np.testing.assert_array_equal(self.lengths(), before)
            return
        assert slot in self.tokens and not (with_tokens and short and held)
        del self.tokens[slot]
        del self.capacity[slot]
        self.prompt.pop(slot, None)

    @rule(
        slot=st.integers(0, BATCH - 1),
        prefix=st.sampled_from(PREFIXES),
        extra=st.lists(st.integers(0, 50), max_size=6),
    )
    def serve(self, slot, prefix, extra):
        """One request's whole life: admitted with its prompt, prefilled, released with
        its tokens (what makes later prompts find their prefix)."""
        if slot in self.tokens:
            return
        self.admit(slot, prefix, 12, 16)
        if slot in self.tokens:
            self.load(slot, extra)
            self.release(slot, True, False)

    @rule()
    def commit(self):
        self.state = self.cache.commit(self.state)

    @invariant()
    def kv_is_the_models(self):
        if not hasattr(self, "cache"):
            return
        want = [len(self.tokens.get(b, [])) for b in range(BATCH)]
        np.testing.assert_array_equal(self.lengths(), want)
        for slot, tokens in self.tokens.items():
            if not tokens:
                continue
            expected = rows_of(tokens, 0)
            layer = len(tokens) % LAYERS
            k, v = self.cache.read(self.state, layer, slot)
            np.testing.assert_array_equal(k, expected[layer])
            np.testing.assert_array_equal(v, -expected[layer])


PROFILE = settings(
    derandomize=True, database=None, deadline=None, max_examples=10, stateful_step_count=40
)


@PROFILE
class OneDevice(HostCalls):
    pass


def test_host_calls_on_one_device_match_the_model():
    HostCalls.seen.clear()
    OneDevice.TestCase().runTest()
    # Not vacuous: prefixes were mapped and calls refused along the way.
    assert HostCalls.seen["prefix hits"] and HostCalls.seen["refused admits"], HostCalls.seen


@pytest.mark.skipif(len(jax.devices()) < 4, reason="needs 4 (simulated) devices")
@pytest.mark.slow
def test_host_calls_on_a_2x2_mesh_match_the_model():
    mesh = jax.make_mesh((2, 2), ("data", "model"), axis_types=(jax.sharding.AxisType.Auto,) * 2)

    @PROFILE
    class OnMesh(HostCalls):
        pass

    OnMesh.mesh = mesh
    HostCalls.seen.clear()
    OnMesh.TestCase().runTest()
    assert HostCalls.seen["prefix hits"] and HostCalls.seen["refused admits"], HostCalls.seen
