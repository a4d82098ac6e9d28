"""The model the mesh tests decode with: projections around prefetching_attention, and the
same model on one device over a resident cache as the oracle."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

import jax_tpusync as tps

LAYERS, BATCH, MAX_LEN, KV_HEADS, Q_HEADS, HEAD_DIM = 2, 4, 64, 4, 8, 16
CONTEXT = np.array([20, 13, 7, 30])  # Ragged: every slot reads its own cached rows.
STEPS = 3


def local_numpy(x: jax.Array) -> np.ndarray:
    """``x`` as NumPy, with NaN where another process holds the values."""
    out = np.full(x.shape, np.nan, np.float32)
    for piece in x.addressable_shards:
        out[piece.index] = np.asarray(piece.data)
    return out


class MeshTestModel:
    batch = BATCH

    def __init__(self, seed: int = 0):
        rng = np.random.default_rng(seed)
        width = Q_HEADS * HEAD_DIM

        def w(*shape):
            return np.asarray(rng.standard_normal(shape) * 0.2, np.float32)

        self.wq = w(LAYERS, width, Q_HEADS * HEAD_DIM)
        self.wk = w(LAYERS, width, KV_HEADS * HEAD_DIM)
        self.wv = w(LAYERS, width, KV_HEADS * HEAD_DIM)
        self.context_k = w(LAYERS, BATCH, MAX_LEN, KV_HEADS, HEAD_DIM) * 5
        self.context_v = w(LAYERS, BATCH, MAX_LEN, KV_HEADS, HEAD_DIM) * 5
        self.x0 = w(BATCH, 1, width) * 5

    @staticmethod
    def cache_args(**overrides) -> dict:
        args = dict(
            num_layers=LAYERS,
            batch=BATCH,
            max_len=MAX_LEN,
            num_kv_heads=KV_HEADS,
            head_dim=HEAD_DIM,
            dtype=jnp.float32,
        )
        args.update(overrides)
        return args

    def qkv(self, x, layer, wq=None, wk=None, wv=None):
        b, t, _ = x.shape
        wq = jnp.asarray(self.wq)[layer] if wq is None else wq
        wk = jnp.asarray(self.wk)[layer] if wk is None else wk
        wv = jnp.asarray(self.wv)[layer] if wv is None else wv
        return (
            (x @ wq).reshape(b, t, -1, HEAD_DIM),
            (x @ wk).reshape(b, t, -1, HEAD_DIM),
            (x @ wv).reshape(b, t, -1, HEAD_DIM),
        )

    def load_context(self, cache, state):
        for layer in range(LAYERS):
            state = cache.load(
                state, layer, self.context_k[layer], self.context_v[layer], lengths=CONTEXT
            )
        return state

    def step(self, *, scan: bool = False):
        """jit(step)(x, state) -> (x, state, k [layers, B, 1, H, D], v [same])."""

        def layer_fn(x, state, layer):
            q, k, v = self.qkv(x, layer)
            o, state = tps.prefetching_attention(q, k, v, state, layer=layer)
            return x + o.reshape(x.shape), state, k, v

        def step(x, state):
            if scan:

                def body(carry, layer):
                    x, state, k, v = layer_fn(*carry, layer)
                    return (x, state), (k, v)

                (x, state), (ks, vs) = jax.lax.scan(body, (x, state), jnp.arange(LAYERS))
                return x, state, ks, vs
            ks, vs = [], []
            for layer in range(LAYERS):
                x, state, k, v = layer_fn(x, state, layer)
                ks.append(k)
                vs.append(v)
            return x, state, jnp.stack(ks), jnp.stack(vs)

        return jax.jit(step, donate_argnums=(1,))

    def run_offloaded(self, cache, state, *, scan: bool = False, mesh=None, step=None):
        """Decodes STEPS tokens; returns (logits per step [B, 1, W], written (k, v) per
        step, state). With ``mesh``, x starts sharded over its data axis."""
        step = step or self.step(scan=scan)
        x = jnp.asarray(self.x0)
        if mesh is not None:
            x = jax.device_put(
                self.x0, jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("data"))
            )
        logits, written = [], []
        for _ in range(STEPS):
            x, state, ks, vs = step(x, state)
            logits.append(local_numpy(x))
            written.append((local_numpy(ks), local_numpy(vs)))
            x = x * 0.5
        return logits, written, state

    def run_resident(self):
        """Logits per step of the same model on one device over a resident cache."""
        ck, cv = jnp.asarray(self.context_k), jnp.asarray(self.context_v)

        @jax.jit
        def step(x, ck, cv, lengths):
            for layer in range(LAYERS):
                q, k, v = self.qkv(x, layer)
                o, k_l, v_l = tps.resident_attention(q, k, v, ck[layer], cv[layer], lengths)
                ck, cv = ck.at[layer].set(k_l), cv.at[layer].set(v_l)
                x = x + o.reshape(x.shape)
            return x, ck, cv

        x, lengths, logits = jnp.asarray(self.x0), jnp.asarray(CONTEXT, jnp.int32), []
        for _ in range(STEPS):
            x, ck, cv = step(x, ck, cv, lengths)
            logits.append(np.asarray(x))
            lengths, x = lengths + 1, x * 0.5
        return logits

    def expected_tier(self, written):
        """Per layer, K and V [B, MAX_LEN, H, D]: the context, then each step's rows."""
        k, v = self.context_k.copy(), self.context_v.copy()
        for i, (ks, vs) in enumerate(written):
            at = CONTEXT + i
            for b in range(BATCH):
                k[:, b, at[b]] = ks[:, b, 0]
                v[:, b, at[b]] = vs[:, b, 0]
        return k, v

    def tier_matches(self, cache, state, written) -> bool:
        """Whether each local shard's tier rows ``[0, length)`` are, byte for byte, the
        context and the rows its steps wrote, for its own sequences and heads."""
        want_k, want_v = self.expected_tier(written)
        final = CONTEXT + len(written)
        for s, shard in cache.shards.items():
            rows, heads = cache.rows_of(s), cache.heads_of(s)
            for layer in range(LAYERS):
                got_k, got_v = shard.read_all(layer, final[rows])
                for got, want in ((got_k, want_k), (got_v, want_v)):
                    want = want[layer][rows][:, :, heads]
                    for j, n in enumerate(final[rows]):
                        if not np.array_equal(
                            got[j, :n].view(np.uint32), want[j, :n].view(np.uint32)
                        ):
                            return False
        return True
