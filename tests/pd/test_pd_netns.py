"""P/D transfer between two network namespaces over a veth pair: the prefill process in a
namespace of its own, this process (the decode side) at the other end of the pair; the
decode logits equal a local prefill's. Needs root (to make the namespace and the pair):
skipped otherwise, and wherever the kernel or container refuses them."""

from __future__ import annotations

import numpy as np
import pytest

from jax_tpusync.pd.transfer import KVReceiver

from support import pd_peers
from support.pd_steps import TIMEOUT, decode_step, local_first_step, one_token, peer

# Skipped without the Mooncake client, failed instead where TPUSYNC_REQUIRE_MOONCAKE=1
# (tests/conftest.py).
pytestmark = pytest.mark.usefixtures("mooncake_usable")


@pytest.mark.slow
def test_pd_over_a_veth_pair_equals_a_local_prefill(veth_pair):
    ns, prefill_ip, decode_ip = veth_pair
    cfg, params = pd_peers.model()
    step = decode_step(cfg)
    prompt = np.random.default_rng(11).integers(0, cfg.vocab, 45)
    first, want = local_first_step(step, params, prompt)

    cache = pd_peers.make_cache()
    state = cache.init(admit=False)
    with (
        peer(pd_peers.serve_prefill, "ok", 10.0, prefill_ip, ns) as (proc, queue),
        KVReceiver(cache, host=decode_ip, deadline_s=60) as rx,
    ):
        address = queue.get(timeout=TIMEOUT)
        assert address.startswith(prefill_ip + ":")
        state, got = rx.receive(state, 1, prompt, prefill=address)
        queue.get(timeout=TIMEOUT)
        proc.join(TIMEOUT)
    assert got.extra["first_token"] == first
    logits, state = one_token(step, params, cache, state, 1, first)
    np.testing.assert_array_equal(logits, want)
    cache.close(state)
