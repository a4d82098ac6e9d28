"""A retrieval task whose answer needs one KV block, and a two-layer decoder built by hand
to solve it: what the ``retrieval`` and ``sparse`` benchmarks measure sparse decode on.

No long-context checkpoint can be downloaded where this project is developed, and a model
with random weights attends almost uniformly (every block holds a little of the weight:
no selection of blocks can be right). This model's weights are constructed, not trained,
from one seed (:func:`build`), so that its attention is as peaked as a trained retrieval
head's and its answer depends on one block of a long context.

**The task.** The context is filler (noise words) with *records*: a record is
``answer_tokens`` consecutive tokens ``record(key, slot j, digit d)`` that say "key's
digit at slot j is d"; a record never straddles a KV block. One record holds the asked
key (the *needle*, planted at a chosen depth); the asked key's *siblings* (keys whose
directions have cosine ``sibling_cos`` with it: hard negatives) have records of their
own, and so do ``records`` other keys. The question is ``ask(key)``, the first decode
step; the model answers with ``answer(j, d)`` for j = 0, 1, ... (greedy, each answer fed
back), and a trial is right when every slot's digit is.

**The model** (no norms, no MLP, one KV head of ``head_dim`` per layer, float32). The
residual stream has named sections (:meth:`RetrievalModel.sections`): the token's own
features (``key`` direction, ``slot`` and ``digit`` one-hots of a record, ``ask`` flag,
``next`` slot to answer, a constant ``one``) and two sections only attention writes
(``asked``: the question's key; ``retrieved``: the answer's digit).

* Layer 0 (the *question head*): every query is ``one``, only ``ask`` tokens have a key
  (score ``ask_logit``), and values carry the key direction: each decode row copies the
  question's key into ``asked`` (the question is always in the recent block).
* Layer 1 (the *retrieval head*): the query is ``key_logit`` x ``asked`` + ``slot_logit``
  x ``next``; a record's key is its key direction and its slot one-hot, its value its
  digit, written into ``retrieved``. The needle's row for the slot asked scores
  ``key_logit + slot_logit``; a sibling's ``sibling_cos x key_logit + slot_logit``; a
  noise word (key ``noise_scale`` x a random unit vector) about 0.
* Logits: ``answer(j, d)`` gets ``answer_logit`` x (``retrieved[d]`` + ``next[j]``).

Attention outputs go to sections no key or value projection reads, so every layer's
context K/V is a function of the token alone (:func:`context_kv`): a 128K-token context is
"prefilled" by two matrix products per layer, no attention (what makes the task cheap on
a CPU; tests check it equals a causal forward on a short context).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any, NamedTuple

import numpy as np


@dataclasses.dataclass(frozen=True)
class RetrievalModel:
    """The task's vocabulary and the constructed model's gains (see the module doc)."""

    families: int = 32  # groups of sibling keys
    siblings: int = 4  # keys per family
    sibling_cos: float = 0.8  # cosine between the key directions of two siblings
    answer_tokens: int = 8  # slots of a record: the decode steps of one answer
    digits: int = 16
    noise_words: int = 1024
    noise_scale: float = 0.3  # norm of a noise word's key direction (records': 1)
    head_dim: int = 64
    ask_logit: float = 30.0
    key_logit: float = 100.0
    slot_logit: float = 30.0
    answer_logit: float = 10.0
    seed: int = 0

    def __post_init__(self):
        for name in ("families", "siblings", "answer_tokens", "digits", "noise_words"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)} must be at least 1")
        if not 0.0 <= self.sibling_cos < 1.0:
            raise ValueError(f"sibling_cos={self.sibling_cos} must be in [0, 1)")
        if self.key_dims < self.siblings + 1:
            raise ValueError(
                f"head_dim={self.head_dim} less answer_tokens={self.answer_tokens} leaves "
                f"{self.key_dims} key channels; a family of siblings={self.siblings} needs "
                f"{self.siblings + 1} (a shared direction and one of each key's own)"
            )

    @property
    def keys(self) -> int:
        return self.families * self.siblings

    @property
    def key_dims(self) -> int:
        """Channels of a key direction (the rest of the retrieval head's are the slots)."""
        return self.head_dim - self.answer_tokens

    # -- vocabulary ---------------------------------------------------------------------------

    def record(self, key, slot, digit):
        return self.noise_words + (key * self.answer_tokens + slot) * self.digits + digit

    def ask(self, key):
        return self.noise_words + self.keys * self.answer_tokens * self.digits + key

    def answer(self, slot, digit):
        return self.ask(self.keys) + slot * self.digits + digit

    @property
    def vocab(self) -> int:
        return self.answer(self.answer_tokens, 0)

    # -- residual stream ----------------------------------------------------------------------

    def sections(self) -> dict[str, slice]:
        """Name -> slice of the residual stream."""
        sizes = [
            ("key", self.key_dims),
            ("slot", self.answer_tokens),
            ("digit", self.digits),
            ("ask", 1),
            ("next", self.answer_tokens),
            ("one", 1),
            ("asked", self.key_dims),
            ("retrieved", self.digits),
        ]
        out, at = {}, 0
        for name, size in sizes:
            out[name] = slice(at, at + size)
            at += size
        return out

    @property
    def d_model(self) -> int:
        return max(s.stop for s in self.sections().values())


class Params(NamedTuple):
    embed: Any  # float32[vocab, d_model]
    layers: list  # per layer dict(wq, wk, wv, wo)
    unembed: Any  # float32[d_model, vocab]
    key_directions: np.ndarray  # float32[keys, key_dims]: unit vectors


def key_directions(model: RetrievalModel) -> np.ndarray:
    """float32[keys, key_dims]: unit vectors; within a family every two have cosine
    ``sibling_cos`` exactly (a shared base and orthonormal own parts), across families
    they are independent random directions."""
    rng = np.random.default_rng(model.seed)
    c = model.sibling_cos
    out = []
    for _ in range(model.families):
        basis, _ = np.linalg.qr(rng.standard_normal((model.key_dims, model.siblings + 1)))
        base, own = basis[:, 0], basis[:, 1:].T
        out.append(math.sqrt(c) * base[None] + math.sqrt(1 - c) * own)
    return np.concatenate(out).astype(np.float32)


def build(model: RetrievalModel) -> Params:
    """The model's weights (numpy float32), constructed from ``model.seed``."""
    s, d, dh = model.sections(), model.d_model, model.head_dim
    kd, m, nd = model.key_dims, model.answer_tokens, model.digits
    dirs = key_directions(model)
    rng = np.random.default_rng(model.seed + 1)
    embed = np.zeros((model.vocab, d), np.float32)
    embed[:, s["one"]] = 1.0
    noise = rng.standard_normal((model.noise_words, kd)).astype(np.float32)
    noise *= model.noise_scale / np.linalg.norm(noise, axis=1, keepdims=True)
    embed[: model.noise_words, s["key"]] = noise
    for key in range(model.keys):
        for slot in range(m):
            rows = model.record(key, slot, np.arange(nd))
            embed[rows, s["key"]] = dirs[key]
            embed[rows, s["slot"].start + slot] = 1.0
            embed[rows, s["digit"].start + np.arange(nd)] = 1.0
        embed[model.ask(key), s["key"]] = dirs[key]
        embed[model.ask(key), s["ask"]] = 1.0
        embed[model.ask(key), s["next"].start] = 1.0
    for slot in range(m - 1):
        embed[model.answer(slot, np.arange(nd)), s["next"].start + slot + 1] = 1.0

    root = math.sqrt(dh)  # the attention scales scores by 1 / sqrt(head_dim)
    eye = np.eye

    def zeros(*shape):
        return np.zeros(shape, np.float32)

    # Layer 0: the question head.
    wq0, wk0, wv0, wo0 = zeros(d, dh), zeros(d, dh), zeros(d, dh), zeros(dh, d)
    wq0[s["one"], 0] = root
    wk0[s["ask"], 0] = model.ask_logit
    wk0[s["key"], 1 : 1 + kd] = eye(kd)  # content no query reads: real keys are not empty
    wv0[s["key"], :kd] = eye(kd)
    wo0[:kd, s["asked"]] = eye(kd)
    # Layer 1: the retrieval head.
    wq1, wk1, wv1, wo1 = zeros(d, dh), zeros(d, dh), zeros(d, dh), zeros(dh, d)
    wq1[s["asked"], :kd] = model.key_logit * root * eye(kd)
    wq1[s["next"], kd:] = model.slot_logit * root * eye(m)
    wk1[s["key"], :kd] = eye(kd)
    wk1[s["slot"], kd:] = eye(m)
    wv1[s["digit"], :nd] = eye(nd)
    wo1[:nd, s["retrieved"]] = eye(nd)
    unembed = zeros(d, model.vocab)
    for slot in range(m):
        cols = model.answer(slot, np.arange(nd))
        unembed[s["retrieved"].start + np.arange(nd), cols] = model.answer_logit
        unembed[s["next"].start + slot, cols] = model.answer_logit
    layers = [
        dict(wq=wq0, wk=wk0, wv=wv0, wo=wo0),
        dict(wq=wq1, wk=wk1, wv=wv1, wo=wo1),
    ]
    return Params(embed, layers, unembed, dirs)


def forward(model: RetrievalModel, params: Params, tokens, state, attend):
    """tokens int32[batch, T] -> (logits float32[batch, vocab] of each last token, state);
    ``attend(layer, q, k, v, state) -> (out, state)`` with q/k/v ``[batch, T, 1,
    head_dim]`` (:func:`jax_tpusync.prefetching_attention` has this form)."""
    import jax.numpy as jnp

    b, t = tokens.shape
    x = jnp.asarray(params.embed)[tokens]
    for layer, p in enumerate(params.layers):
        q, k, v = ((x @ jnp.asarray(p[w])).reshape(b, t, 1, -1) for w in ("wq", "wk", "wv"))
        o, state = attend(layer, q, k, v, state)
        x = x + o.reshape(b, t, -1).astype(jnp.float32) @ jnp.asarray(p["wo"])
    return x[:, -1] @ jnp.asarray(params.unembed), state


def context_kv(params: Params, tokens: np.ndarray, dtype=np.float32) -> list[tuple]:
    """Per layer ``(k, v)`` [batch, T, 1, head_dim] of a context: each row from its token
    alone (see the module doc; looked up in a per-token table), in ``dtype``."""
    out = []
    for p in params.layers:
        k_table = (params.embed @ p["wk"]).astype(dtype)
        v_table = (params.embed @ p["wv"]).astype(dtype)
        out.append((k_table[tokens][:, :, None], v_table[tokens][:, :, None]))
    return out


# -- trials ----------------------------------------------------------------------------------


class Trial(NamedTuple):
    tokens: np.ndarray  # int32[context]
    key: int  # the key asked
    digits: np.ndarray  # int[answer_tokens]: the needle's digits
    needle: int  # the needle record's first position


def make_trial(
    model: RetrievalModel,
    context: int,
    depth: float,
    block_tokens: int,
    seed: int,
    records: int = 64,
) -> Trial:
    """One context of ``context`` tokens with the needle at ``depth`` (0: the start, 1: the
    end), the asked key's siblings and ``records`` other keys' records at random places."""
    m = model.answer_tokens
    if block_tokens % m:
        raise ValueError(f"block_tokens={block_tokens} must be a multiple of answer_tokens={m}")
    places = context // m  # record places: multiples of m, never straddling a block
    needed = records + model.siblings  # the needle, its siblings, the others
    if places < needed:
        raise ValueError(
            f"context={context} holds {places} records of {m} tokens; the needle, its "
            f"{model.siblings - 1} siblings and records={records} others need {needed}"
        )
    rng = np.random.default_rng(seed)
    tokens = rng.integers(0, model.noise_words, context).astype(np.int32)
    key = int(rng.integers(model.keys))
    family = key // model.siblings
    siblings = [family * model.siblings + i for i in range(model.siblings)]
    others = [k for k in range(model.keys) if k not in siblings]
    needle = min(places - 1, int(depth * places))
    free = np.setdiff1d(np.arange(places), [needle])
    chosen = rng.choice(free, records + model.siblings - 1, replace=False)
    keyed = [(needle, key)]
    keyed += [(int(p), k) for p, k in zip(chosen, [k for k in siblings if k != key])]
    rest = chosen[model.siblings - 1 :]
    keyed += [(int(p), int(k)) for p, k in zip(rest, rng.choice(others, len(rest)))]
    digits = None
    for place, k in keyed:
        d = rng.integers(model.digits, size=m)
        tokens[place * m : (place + 1) * m] = model.record(k, np.arange(m), d)
        if digits is None:
            digits = d
    return Trial(tokens, key, digits, needle * m)


def depths(count: int) -> np.ndarray:
    """``count`` needle depths spread over the context, the ends excluded (the first and
    last blocks are read whatever the budget)."""
    return (np.arange(count) + 0.5) / count


# -- the decode, through the sparse reference --------------------------------------------------


class Decoded(NamedTuple):
    answers: np.ndarray  # int[batch, answer_tokens]: the tokens decoded
    counts: np.ndarray  # int[steps, layers, 4]: prediction counts (COUNTS) per step
    # The reference's own measures (None through an engine cache):
    recall: np.ndarray | None  # float[steps, layers, batch]: the exact selection's recall
    error: np.ndarray | None  # float[steps, layers, batch]: its output's relative error
    read_blocks: np.ndarray | None  # int[steps, layers, batch]
    stats: dict | None = None  # an engine cache's sparse_stats() after the last step


@functools.lru_cache(maxsize=16)
def _reference_step(model: RetrievalModel, config, block_tokens: int, sparse: bool):
    import jax
    import jax.numpy as jnp

    from jax_tpusync.sparse import measure as measure_mod

    def step(params, token, keys, values, length, previous):
        batch = token.shape[0]
        lengths = jnp.full((batch,), length + 1, jnp.int32)
        found = []

        def attend(layer, q, k, v, kv):
            keys, values = measure_mod.with_row(kv, layer, k, v, length)
            got = measure_mod.measure(
                config,
                q[:, 0],
                keys[layer],
                values[layer],
                lengths,
                block_tokens,
                previous[layer],
            )
            found.append(got)
            out = got.sparse if sparse else got.dense
            return out[:, None], (keys, values)

        logits, (keys, values) = forward(model, params, token[:, None], (keys, values), attend)
        return (
            logits,
            keys,
            values,
            jnp.stack([g.selection for g in found]),
            jnp.stack([g.counts for g in found]),
            jnp.stack([g.recall[:, 0] for g in found]),
            jnp.stack([g.error[:, 0] for g in found]),
            jnp.stack([g.read_blocks for g in found]),
        )

    return jax.jit(step, donate_argnums=(2, 3))


def decode_reference(
    model: RetrievalModel,
    params: Params,
    trials: list[Trial],
    block_tokens: int,
    config=None,  # SparseConfig: the selection measured (and, with sparse, attended)
    sparse: bool = False,
    kv_dtype=None,
) -> Decoded:
    """Answers every trial's question greedily, one batch, through the sparse reference
    (:func:`jax_tpusync.sparse.measure.measure`): attention dense, or (``sparse``) over what
    a layer-ahead sparse step reads (its prediction with the late blocks). The contexts
    have one length."""
    import jax.numpy as jnp

    from jax_tpusync.sparse import SparseConfig

    config = config or SparseConfig(budget=1.0)
    kv_dtype = kv_dtype or jnp.bfloat16
    context = len(trials[0].tokens)
    if any(len(t.tokens) != context for t in trials):
        raise ValueError("every trial of one batch has the same context length")
    m = model.answer_tokens
    kv = context_kv(params, np.stack([t.tokens for t in trials]))
    pad = ((0, 0), (0, m), (0, 0), (0, 0))
    keys = tuple(jnp.asarray(np.pad(k, pad), kv_dtype) for k, _ in kv)
    values = tuple(jnp.asarray(np.pad(v, pad), kv_dtype) for _, v in kv)
    del kv
    step = _reference_step(model, config, block_tokens, sparse)
    width = config.max_selected(-(-(context + m) // block_tokens))
    previous = jnp.full((len(params.layers), len(trials), width), -1, jnp.int32)
    jparams = Params(
        jnp.asarray(params.embed),
        [{n: jnp.asarray(w) for n, w in p.items()} for p in params.layers],
        jnp.asarray(params.unembed),
        params.key_directions,
    )
    token = jnp.asarray([model.ask(t.key) for t in trials], jnp.int32)
    answers, counts, recall, error, read = [], [], [], [], []
    for i in range(m):
        logits, keys, values, previous, c, r, e, nread = step(
            jparams, token, keys, values, jnp.int32(context + i), previous
        )
        token = jnp.argmax(logits, axis=-1).astype(jnp.int32)
        answers.append(np.asarray(token))
        counts.append(np.asarray(c))
        recall.append(np.asarray(r))
        error.append(np.asarray(e))
        read.append(np.asarray(nread))
    return Decoded(
        np.stack(answers, 1), np.stack(counts), np.stack(recall), np.stack(error), np.stack(read)
    )


def decode_engine(
    model: RetrievalModel,
    params: Params,
    trials: list[Trial],
    block_tokens: int,
    config=None,  # SparseConfig, or None: a dense cache
    tier: str = "host",
    path: str | None = None,
    kv_dtype=None,
) -> Decoded:
    """Answers every trial's question greedily, one batch, through
    :func:`jax_tpusync.prefetching_attention` on an :class:`~jax_tpusync.OffloadedKVCache`
    (``sparse=config``; dense without it) of ``tier``, or with ``tier="pool"`` a
    :class:`~jax_tpusync.HostPoolKVCache` (the TPU data path): the context's KV loaded per layer
    (:func:`context_kv`), the decode steps jitted. Per-step counts come from the cache's
    ``sparse_stats``."""
    import jax
    import jax.numpy as jnp

    import jax_tpusync as tps
    from jax_tpusync.sparse.prediction import COUNTS

    kv_dtype = kv_dtype or jnp.bfloat16
    context = len(trials[0].tokens)
    if any(len(t.tokens) != context for t in trials):
        raise ValueError("every trial of one batch has the same context length")
    m, batch = model.answer_tokens, len(trials)
    jparams = Params(
        jnp.asarray(params.embed),
        [{n: jnp.asarray(w) for n, w in p.items()} for p in params.layers],
        jnp.asarray(params.unembed),
        params.key_directions,
    )

    def attend(layer, q, k, v, state):
        q, k, v = (x.astype(kv_dtype) for x in (q, k, v))
        return tps.prefetching_attention(q, k, v, state, layer=layer)

    step = jax.jit(
        lambda p, tokens, state: forward(model, p, tokens, state, attend), donate_argnums=(2,)
    )
    layers = len(params.layers)
    geometry = dict(
        num_layers=layers,
        batch=batch,
        max_len=context + m,
        num_kv_heads=1,
        head_dim=model.head_dim,
        dtype=kv_dtype,
        block_tokens=block_tokens,
        sparse=config,
    )
    if tier == "pool":  # The TPU data path, emulated on this backend's pinned_host.
        opened = tps.HostPoolKVCache(**geometry)
    else:
        opened = tps.OffloadedKVCache(**geometry, tier=tier, path=path)
    with opened as cache:
        state = cache.init(np.zeros(batch, np.int32))
        for layer, (k, v) in enumerate(context_kv(params, np.stack([t.tokens for t in trials]))):
            state = cache.load(
                state,
                layer,
                np.asarray(jnp.asarray(k, kv_dtype)),
                np.asarray(jnp.asarray(v, kv_dtype)),
            )
        token = jnp.asarray([model.ask(t.key) for t in trials], jnp.int32)
        answers, counts, seen, stats = [], [], np.zeros((layers, 4), np.int64), None
        for _ in range(m):
            logits, state = step(jparams, token[:, None], state)
            token = jnp.argmax(logits, axis=-1).astype(jnp.int32)
            answers.append(np.asarray(token))
            if config is not None:
                stats = cache.sparse_stats(state)
                total = np.array([[row[name] for name in COUNTS] for row in stats["layers"]])
                counts.append(total - seen)
                seen = total
            else:
                counts.append(np.zeros((layers, 4), np.int64))
        state = cache.drain(state)
    return Decoded(np.stack(answers, 1), np.stack(counts), None, None, None, stats)


def correct(model: RetrievalModel, trials: list[Trial], answers: np.ndarray) -> np.ndarray:
    """bool[batch]: every slot's answer is the needle's digit."""
    m = model.answer_tokens
    want = np.stack([model.answer(np.arange(m), t.digits) for t in trials])
    return (answers == want).all(axis=1)
