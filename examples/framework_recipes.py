"""The offloaded cache in Flax (Linen and NNX) and Equinox models: recipes that work.

The one rule: a single :class:`jax_tpusync.KVState` is threaded through every layer of a
step, and the step donates it. Where the state lives is the framework's business:

* **Flax Linen**: passed explicitly (``__call__(x, state) -> (y, state)``), or kept in a
  mutable variable collection (``"kv_cache"``). ``model.init`` runs the forward pass, so
  give it ``cache.inert_state()``: a state that moves no bytes (``init`` must not write a
  token to the tier).
* **Flax NNX**: the module owns its parameters; the state is an argument. Split the module
  into graph and parameters (``nnx.split``) so a plain ``jax.jit`` can donate the state
  alone.
* **Equinox**: the model is a pytree; ``eqx.filter_jit(..., donate="all-except-first")``
  donates the state (and the input), never the model.

Each recipe builds the same two-layer attention stack (``q, k, v`` projections and an output
projection per layer). ``python examples/framework_recipes.py`` runs the three and checks them
against each other; the tests in ``tests/attention/test_framework_recipes.py`` check them
against ``resident_attention`` too.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

import jax_tpusync as tps

LAYERS, D_MODEL, Q_HEADS, KV_HEADS, HEAD_DIM = 2, 32, 4, 2, 8


def _heads(x, n):
    """[batch, q_len, n * head_dim] -> [batch, q_len, n, head_dim]."""
    return x.reshape(*x.shape[:2], n, HEAD_DIM)


# -- Flax Linen ---------------------------------------------------------------------------------


def linen_model():
    """A Linen module: ``__call__(x, state) -> (y, state)``, the state threaded explicitly."""
    import flax.linen as nn

    class Layer(nn.Module):
        index: int

        @nn.compact
        def __call__(self, x, state):
            q = _heads(nn.Dense(Q_HEADS * HEAD_DIM, use_bias=False, name="q")(x), Q_HEADS)
            k = _heads(nn.Dense(KV_HEADS * HEAD_DIM, use_bias=False, name="k")(x), KV_HEADS)
            v = _heads(nn.Dense(KV_HEADS * HEAD_DIM, use_bias=False, name="v")(x), KV_HEADS)
            out, state = tps.prefetching_attention(q, k, v, state, layer=self.index)
            y = nn.Dense(D_MODEL, use_bias=False, name="o")(out.reshape(*x.shape[:2], -1))
            return x + y, state

    class Stack(nn.Module):
        @nn.compact
        def __call__(self, x, state):
            for i in range(LAYERS):
                x, state = Layer(i, name=f"layer_{i}")(x, state)
            return x, state

    return Stack()


def linen_decode(cache, x, steps, seed=0):
    """Linen, state passed explicitly: ``model.init`` on the inert state, then decode."""
    model = linen_model()
    params = model.init(jax.random.key(seed), x, cache.inert_state())["params"]

    @jax.jit
    def _step(params, x, state):
        return model.apply({"params": params}, x, state)

    step = jax.jit(_step, donate_argnums=(2,))
    ys, state = _decode(cache, step, params, x, steps)
    return ys, state, params


def linen_collection_decode(cache, x, steps, params):
    """Linen, state kept in a mutable ``"kv_cache"`` collection instead of an argument."""
    import flax.linen as nn

    class WithCollection(nn.Module):
        stack: nn.Module

        @nn.compact
        def __call__(self, x):
            kv = self.variable("kv_cache", "state", cache.inert_state)
            y, kv.value = self.stack(x, kv.value)
            return y

    model = WithCollection(stack=linen_model())

    def _step(params, x, kv):
        y, updated = model.apply(
            {"params": {"stack": params}, "kv_cache": kv}, x, mutable=["kv_cache"]
        )
        return y, updated["kv_cache"]

    step = jax.jit(_step, donate_argnums=(2,))  # The collection alone is donated.
    kv = {"state": cache.init([0] * cache.spec.batch)}
    ys = []
    for _ in range(steps):
        y, kv = step(params, x, kv)
        ys.append(np.asarray(y))
        x = y  # Decode feeds its output back.
    return ys, cache.drain(kv["state"])


# -- Flax NNX -----------------------------------------------------------------------------------


def nnx_decode(cache, x, steps, linen_params):
    """NNX: the module owns its weights (copied from the Linen ones, to compare), the state
    is an argument; nnx.split lets jax.jit donate the state alone."""
    from flax import nnx

    class Layer(nnx.Module):
        def __init__(self, index, p, rngs):
            self.index = index
            self.q = nnx.Linear(D_MODEL, Q_HEADS * HEAD_DIM, use_bias=False, rngs=rngs)
            self.k = nnx.Linear(D_MODEL, KV_HEADS * HEAD_DIM, use_bias=False, rngs=rngs)
            self.v = nnx.Linear(D_MODEL, KV_HEADS * HEAD_DIM, use_bias=False, rngs=rngs)
            self.o = nnx.Linear(Q_HEADS * HEAD_DIM, D_MODEL, use_bias=False, rngs=rngs)
            for name in ("q", "k", "v", "o"):
                getattr(self, name).kernel[...] = jnp.asarray(p[name]["kernel"])

        def __call__(self, x, state):
            q = _heads(self.q(x), Q_HEADS)
            k = _heads(self.k(x), KV_HEADS)
            v = _heads(self.v(x), KV_HEADS)
            out, state = tps.prefetching_attention(q, k, v, state, layer=self.index)
            return x + self.o(out.reshape(*x.shape[:2], -1)), state

    class Stack(nnx.Module):
        def __init__(self, rngs):
            self.layers = nnx.List(
                [Layer(i, linen_params[f"layer_{i}"], rngs) for i in range(LAYERS)]
            )

        def __call__(self, x, state):
            for layer in self.layers:
                x, state = layer(x, state)
            return x, state

    graph, weights = nnx.split(Stack(nnx.Rngs(0)))

    def _step(weights, x, state):
        return nnx.merge(graph, weights)(x, state)

    step = jax.jit(_step, donate_argnums=(2,))
    return _decode(cache, step, weights, x, steps)


# -- Equinox ------------------------------------------------------------------------------------


def equinox_decode(cache, x, steps, linen_params):
    """Equinox: the model is a pytree of weights; filter_jit donates all but the model."""
    import equinox as eqx

    class Layer(eqx.Module):
        index: int = eqx.field(static=True)
        wq: jax.Array
        wk: jax.Array
        wv: jax.Array
        wo: jax.Array

        def __call__(self, x, state):
            q = _heads(x @ self.wq, Q_HEADS)
            k = _heads(x @ self.wk, KV_HEADS)
            v = _heads(x @ self.wv, KV_HEADS)
            out, state = tps.prefetching_attention(q, k, v, state, layer=self.index)
            return x + out.reshape(*x.shape[:2], -1) @ self.wo, state

    class Stack(eqx.Module):
        layers: list

        def __call__(self, x, state):
            for layer in self.layers:
                x, state = layer(x, state)
            return x, state

    model = Stack(
        [
            Layer(i, *(jnp.asarray(linen_params[f"layer_{i}"][n]["kernel"]) for n in "qkvo"))
            for i in range(LAYERS)
        ]
    )

    @eqx.filter_jit(donate="all-except-first")  # The state and x; never the model.
    def step(model, x, state):
        return model(x, state)

    return _decode(cache, step, model, jnp.array(x, copy=True), steps)  # x is donated.


def _decode(cache, step, weights, x, steps):
    """``steps`` calls of ``step(weights, x, state) -> (y, state)`` from a fresh state, each
    output fed back as the next input; returns (the outputs, the drained state)."""
    state = cache.init([0] * cache.spec.batch)
    ys = []
    for _ in range(steps):
        x, state = step(weights, x, state)
        ys.append(np.asarray(x))
    return ys, cache.drain(state)


def new_cache(**kwargs):
    return tps.OffloadedKVCache(
        num_layers=LAYERS,
        batch=2,
        max_len=64,
        num_kv_heads=KV_HEADS,
        head_dim=HEAD_DIM,
        dtype=jnp.float32,
        staging_bytes=1 << 20,
        **kwargs,
    )


def main() -> None:
    x = jnp.asarray(np.random.default_rng(0).standard_normal((2, 1, D_MODEL)), jnp.float32)
    with new_cache() as cache:
        linen, _, params = linen_decode(cache, x, steps=4)
    results = {"linen": linen}
    with new_cache() as cache:
        results["linen (collection)"], _ = linen_collection_decode(cache, x, 4, params)
    with new_cache() as cache:
        results["nnx"], _ = nnx_decode(cache, x, 4, params)
    with new_cache() as cache:
        results["equinox"], _ = equinox_decode(cache, x, 4, params)
    for name, ys in results.items():
        err = max(float(np.max(np.abs(a - b))) for a, b in zip(ys, linen))
        print(f"{name:<20} 4 steps, max |y - linen| = {err:.2g}")
        assert err < 1e-5, name


if __name__ == "__main__":
    main()
