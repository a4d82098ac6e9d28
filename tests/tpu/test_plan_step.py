"""``jax_tpusync.tpu.plan_step`` on decode steps written outside the bench (other layer and
head counts, GQA ratios, head sizes, batches, block sizes, staging budgets, a Gemma-3-like
window pattern, a mesh split), compiled for v5e, v6e and TPU7x with libtpu's compiler
(nothing runs): every unit copy overlaps an attention on each generation, and the device
memory of a user's mesh step stays flat from 32K to 1M tokens. The compiles run in a child
process per topology (libtpu reads its settings when JAX starts): support/plan_user_steps.py.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import platform
import subprocess
import sys

import pytest

from support import child_env

# libtpu's wheels are Linux x86_64 only: there the test extra installs it, and a missing
# one is a failure, not a skip.
REQUIRED = sys.platform == "linux" and platform.machine() == "x86_64"
MODELS = ("issue", "mqa", "odd_batch", "wide_batch", "gemma_mesh")
LAYERS = dict(issue=6, mqa=2, odd_batch=2, wide_batch=2, gemma_mesh=3)
BATCH_PER_CHIP = dict(issue=2, mqa=4, odd_batch=3, wide_batch=8, gemma_mesh=2)
BLOCK_TOKENS = dict(issue=256, mqa=128, odd_batch=512, wide_batch=256, gemma_mesh=256)


def plans_for(tmp_path_factory, topology: str, *requests: str) -> dict:
    """``{model name: plan dict}`` of support/plan_user_steps.py for ``topology``."""
    if importlib.util.find_spec("libtpu") is None:
        if REQUIRED:
            pytest.fail("libtpu is not installed: pip install '.[test]' installs it here")
        pytest.skip("libtpu has no wheel for this platform")
    done = subprocess.run(
        [sys.executable, "-m", "support.plan_user_steps", topology, *requests],
        capture_output=True, text=True, timeout=1200, cwd=tmp_path_factory.mktemp("plan"),
        env=child_env(JAX_PLATFORMS="cpu"),
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    out = {}
    for line in done.stdout.splitlines():
        if line.startswith("{"):
            row = json.loads(line)
            out[row["name"]] = dict(row["plan"], summary=row["summary"])
    return out


def bounded(c: dict) -> float:
    """The most device memory a step may hold, whatever its context: the weights, and the
    units: those the state stages and the one in flight (``staging_bytes``), and while a
    unit is attended its joined copy and the compiler's copy of the staged one (measured
    2.2-2.3 times the staging beside the weights on v5e, v6e and TPU7x; the same, to 0.3
    MiB, when units were joined where they were copied)."""
    return c["weights_bytes"] + 2.5 * c["staging_bytes"]


@pytest.fixture(scope="module", params=["v5e:2x2", "v6e:2x2", "tpu7x:2x2x1"])
def generation(request, tmp_path_factory):
    """Every model planned at 32K tokens on one generation; on v6e the Gemma-like mesh
    step at 1M tokens too."""
    topology = request.param
    requests = [m for m in MODELS if m != "gemma_mesh"]
    requests.append("gemma_mesh@32768,1048576" if topology == "v6e:2x2" else "gemma_mesh")
    return topology, plans_for(tmp_path_factory, topology, *requests)


@pytest.mark.slow
def test_every_unit_copy_overlaps_an_attention_for_steps_unlike_the_benchs(generation):
    topology, plans = generation
    assert sorted(plans) == sorted(MODELS)
    for name, plan in plans.items():
        assert plan["topology"] == topology and plan["ran_on_tpu"] is False
        for c in plan["contexts"]:
            # One unit loop per layer, each copying one unit ahead of its attention: every
            # copy started before the attention and waited for after it.
            assert c["computations"] == LAYERS[name], (name, c)
            assert c["copies"] == LAYERS[name] * c["unit_copies"] > 0, (name, c)
            assert c["overlapped"] == c["started_before"] == c["copies"], (name, topology, c)
            # A unit's copies (a block and a tail per slot) within the 32 in flight: as
            # many blocks as fit, unless the staging holds fewer.
            blocks = c["chunk_len"] // BLOCK_TOKENS[name]
            assert c["unit_copies"] == BATCH_PER_CHIP[name] * (blocks + 1) <= 32, (name, c)
        assert plan["all_overlapped"] is True, (name, plan["summary"])
        total = sum(c["copies"] for c in plan["contexts"])
        assert f"  {total} of {total} unit copies are started before" in plan["summary"]


@pytest.mark.slow
def test_the_issues_step_is_bounded_and_projected_over_its_generations_link(generation):
    topology, plans = generation
    plan = plans["issue"]
    link = {"v5e:2x2": 13.0, "v6e:2x2": 15.0, "tpu7x:2x2x1": 190 / 8}[topology]
    assert plan["link_gbps"] == pytest.approx(link)
    (c,) = plan["contexts"]
    # Six layers of 2 slots x 4 KV heads x 128, bf16: 4 KiB a token of both slots.
    assert c["resident_bytes"] == c["weights_bytes"] + 6 * 32768 * 2 * 2 * 4 * 128 * 2
    assert c["device_bytes"] <= bounded(c), c
    assert c["projected_step_ms"] == pytest.approx(c["step_copy_bytes"] / (link * 1e9) * 1e3)
    # Whole units a step copies: at least the KV it reads.
    assert c["step_copy_bytes"] >= 6 * 32768 * 2 * 2 * 4 * 128 * 2
    assert plan["does_not_fit"] == [] and "everything fits" in plan["summary"]


@pytest.mark.slow
def test_a_users_gemma_like_mesh_step_holds_the_same_device_memory_at_32k_and_1m(generation):
    topology, plans = generation
    if topology != "v6e:2x2":
        pytest.skip("planned at 1M on v6e only (one more compile)")
    plan = plans["gemma_mesh"]
    assert plan["chips"] == 4 and plan["mesh_axes"] == {"batch": 2, "heads": 2}
    short, long = plan["contexts"]
    assert (short["context"], long["context"]) == (32768, 1048576)
    assert plan["device_bytes_flat"] is True
    assert abs(long["device_bytes"] - short["device_bytes"]) <= 0.01 * short["device_bytes"]
    for c in (short, long):
        assert c["device_bytes"] <= bounded(c), c
    # Per chip: 2 of the 4 slots, 2 of the 4 KV heads of 128, bf16 (1 KiB a token of a
    # slot); the pool keeps every position of 3 layers, 32 times as many at 1M.
    assert long["pool_bytes"] == pytest.approx(32 * short["pool_bytes"], rel=0.01)
    # Resident: two sliding layers hold their 1024 tokens, the global one every token.
    per_token = 2 * 2 * 2 * 128 * 2
    assert long["resident_bytes"] == long["weights_bytes"] + (2 * 1024 + 2**20) * per_token
    assert long["resident_bytes"] > 50 * long["device_bytes"]
    assert " at every context (32K and 1M tokens; weights " in plan["summary"]


# -- without compiling --------------------------------------------------------------------


def context_plan(context=32768, device_bytes=100 << 20, **changes):
    from jax_tpusync.tpu import ContextPlan

    fields = dict(
        context=context, device_bytes=device_bytes, refusal="", weights_bytes=60 << 20,
        staging_bytes=30 << 20, pool_bytes=context << 10, resident_bytes=context << 12,
        chunk_len=3840, prefetch_depth=1, unit_copies=32, computations=6, copies=192,
        started_before=192, overlapped=192, step_copy_bytes=context << 10,
        projected_step_ms=1.5, flops=1.0, bytes_accessed=2.0, compile_s=3.0,
    )  # fmt: skip
    fields.update(changes)
    return ContextPlan(**fields)


def step_plan(*contexts, hbm_bytes=16 << 30):
    from jax_tpusync.tpu import StepPlan

    return StepPlan(
        topology="v5e:2x2", device_kind="TPU v5 lite", chips=1, mesh_axes={},
        link_gbps=13.0, link_source="a source", hbm_bytes=hbm_bytes, contexts=tuple(contexts),
    )  # fmt: skip


def test_each_generation_projects_over_its_own_published_host_link():
    from jax_tpusync.tpu import host_link
    from jax_tpusync.tpu.chips import FALLBACK_LINK

    assert host_link("TPU v5 lite").gbps == 13.0 and "v5e" in host_link("TPU v5 lite").source
    assert host_link("TPU v6 lite").gbps == 15.0 and "v6e" in host_link("TPU v6 lite").source
    assert host_link("TPU7x").gbps == pytest.approx(23.75)
    # v4 and v5p have no figure of their own: the scaling book's PCIe figure, said so.
    for kind in ("TPU v4", "TPU v5", "TPU v5p"):
        assert host_link(kind) == FALLBACK_LINK
    assert FALLBACK_LINK.gbps == 15.0 and "no published figure" in FALLBACK_LINK.source


def test_a_chips_device_memory_is_shared_by_the_devices_it_shows():
    from jax_tpusync.tpu import hbm_bytes_per_device

    assert hbm_bytes_per_device("TPU v5 lite") == 16 << 30
    assert hbm_bytes_per_device("TPU v6 lite") == 32 << 30
    assert hbm_bytes_per_device("TPU v5") == 95 << 30
    assert hbm_bytes_per_device("TPU7x", 2) == 96 << 30
    assert hbm_bytes_per_device("cpu") is None


def test_a_plan_says_in_words_and_as_data_what_it_holds_and_what_does_not_fit():
    short = context_plan(32768, resident_bytes=2 << 30)
    # At 1M: the resident baseline past the chip's 16 GiB, ours refused by the compiler.
    long = context_plan(
        1 << 20, device_bytes=None, refusal="does not fit: needs 20000 MiB of temporaries",
        resident_bytes=40 << 30, overlapped=0, started_before=0, copies=0, computations=0,
    )  # fmt: skip
    plan = step_plan(short, long)
    assert plan.does_not_fit == [
        "the step at 1M tokens: does not fit: needs 20000 MiB of temporaries",
        "the whole KV resident at 1M tokens: 40.0 GiB of a chip's 16.0 GiB",
    ]
    assert not plan.all_overlapped and not plan.device_bytes_flat
    data = json.loads(plan.to_json())
    assert data["does_not_fit"] == plan.does_not_fit and data["all_overlapped"] is False
    assert data["contexts"][1]["device_bytes"] is None and data["ran_on_tpu"] is False
    text = plan.summary()
    assert str(plan) == text
    assert text.splitlines() == [
        "v5e:2x2 (TPU v5 lite, 1 chip), per chip:",
        "  device memory: 100 MiB at every context (32K and 1M tokens; weights 60 MiB + staging"
        " 30 MiB)",
        "  whole KV resident instead: 2048 MiB at 32K; 40.0 GiB at 1M (a chip has 16.0 GiB)",
        "  the pool in host memory: 32 MiB at 32K; 1024 MiB at 1M",
        "  192 of 192 unit copies are started before the attention they overlap and waited for"
        " after it (units of 3840 tokens, 32 copies each)",
        "  projected step time over a 13.00 GB/s host link (a source): 1.5 ms at 32K, 1.5 ms at"
        " 1M",
        "  does not fit: the step at 1M tokens: does not fit: needs 20000 MiB of temporaries;"
        " the whole KV resident at 1M tokens: 40.0 GiB of a chip's 16.0 GiB",
        "Compiled only: nothing ran on a TPU; the memory is the compiler's plan and the step"
        " time a projection from the bytes copied.",
    ]
    fits = step_plan(short, context_plan(1 << 20, resident_bytes=16 << 30))
    assert fits.does_not_fit == [] and "  everything fits" in fits.summary().splitlines()


def test_device_memory_is_flat_within_one_percent_and_every_copy_must_overlap():
    base = 100 << 20
    at_edge = step_plan(context_plan(), context_plan(1 << 20, device_bytes=base + base // 100))
    assert at_edge.device_bytes_flat
    past = step_plan(context_plan(), context_plan(1 << 20, device_bytes=base + base // 100 + 1))
    assert not past.device_bytes_flat
    assert "100 MiB-101 MiB across the contexts" in past.summary()
    assert at_edge.all_overlapped
    one_short = step_plan(context_plan(), context_plan(1 << 20, overlapped=191))
    assert not one_short.all_overlapped
    assert not step_plan(context_plan(copies=0, overlapped=0)).all_overlapped


def test_a_sparse_plans_verdict_needs_every_unit_and_summary_copy_to_span_an_attention():
    """A sparse step attends its walk's first unit outside the loop (among every layer's
    attention): its verdict counts copies with an attention, a walk or a scoring between
    start and end, the summary chunk copies' as well as the units'."""
    from jax_tpusync.tpu import SparseContextPlan

    def sparse(spanning, copies):
        overlap = dict(
            computations=1, copies=copies, started_before=0, overlapped=0, spanning=spanning
        )
        return SparseContextPlan(
            context_blocks=128, selected_blocks=4, summary_layer_bytes=1 << 20,
            summary_chunk_blocks=128, summary_host_bytes=8 << 20, summary_overlap=overlap,
        )  # fmt: skip

    units = dict(copies=192, overlapped=96, spanning=192)  # Half start before a loop body's.
    assert context_plan(sparse=sparse(8, 8), **units).all_overlapped
    assert not context_plan(sparse=sparse(7, 8), **units).all_overlapped
    assert not context_plan(sparse=sparse(0, 0), **units).all_overlapped  # None found.
    one_unit_short = dict(units, spanning=191)
    assert not context_plan(sparse=sparse(8, 8), **one_unit_short).all_overlapped
    assert not context_plan(device_bytes=None, sparse=sparse(8, 8), **units).all_overlapped
    # The dense verdict is unchanged: started before the loop body's attention, ended after.
    assert not context_plan(**units).all_overlapped
    plan = step_plan(context_plan(sparse=sparse(8, 8), **units))
    assert plan.all_overlapped and plan.to_dict()["all_overlapped"] is True
    assert not step_plan(
        context_plan(sparse=sparse(8, 8), **units), context_plan(sparse=sparse(1, 2), **units)
    ).all_overlapped


def test_bad_arguments_are_refused_by_name_before_anything_compiles():
    import jax
    import jax.numpy as jnp

    from jax_tpusync.tpu import plan_step
    from jax_tpusync.tpu.target import topology_mesh

    cache = dict(num_layers=1, batch=3, num_kv_heads=2, head_dim=64, dtype=jnp.bfloat16)
    params = [dict(w=jax.ShapeDtypeStruct((8, 8), jnp.bfloat16))]

    def plan(**options):
        return plan_step(lambda p, s: (p, s), params, cache, **options)

    with pytest.raises(ValueError, match=r"contexts is empty"):
        plan(contexts=())
    with pytest.raises(ValueError, match=r"context 0 must be an int of at least 1 token"):
        plan(contexts=(0,))
    with pytest.raises(ValueError, match=r"link_gbps=0 must be positive"):
        plan(link_gbps=0)
    with pytest.raises(ValueError, match=r"batch=3 must be a multiple of the 2 chips"):
        plan(mesh_axes={"batch": 2}, batch_axis="batch")
    with pytest.raises(TypeError, match=r"cache must be kv_cache keywords"):
        plan_step(lambda p, s: (p, s), params, [cache], mesh_axes={"b": 1}, batch_axis="b")
    with pytest.raises(ValueError, match=r"cache has no batch"):
        plan_step(
            lambda p, s: (p, s), params, {"num_layers": 1}, mesh_axes={"b": 1}, batch_axis="b"
        )
    with pytest.raises(ValueError, match=r"\{'x': 8\} needs 8 devices; the topology has 4"):
        topology_mesh([object()] * 4, {"x": 8})
    with pytest.raises(ValueError, match=r"mesh axis 'x' has size 0: each must be an int >= 1"):
        topology_mesh([object()] * 4, {"x": 0})


def test_a_context_plan_holds_every_field_the_json_names():
    plan = step_plan(context_plan())
    data = plan.to_dict()
    assert set(data["contexts"][0]) == {f.name for f in dataclasses.fields(context_plan())}
    assert {"all_overlapped", "device_bytes_flat", "does_not_fit"} <= set(data)


def test_a_sparse_caches_abstract_state_carries_its_summaries_in_host_memory():
    """plan_step traces a sparse cache's step with its sparse part as shapes: the block
    summaries in host memory, the selection and the staged chunk on the device."""
    import jax
    import jax.numpy as jnp

    from jax_tpusync.core.config import CacheConfig
    from jax_tpusync.core.pool_sparse import PoolSparseState, SummaryLayout
    from jax_tpusync.tpu.abstract_state import abstract_pool_state

    cache = dict(
        num_layers=2, batch=1, num_kv_heads=2, head_dim=64, dtype=jnp.bfloat16,
        max_len=131072, block_tokens=256,
    )  # fmt: skip
    devices = jax.devices("cpu")
    dense, _ = abstract_pool_state(CacheConfig.from_kwargs(**cache), devices)
    assert dense.sparse is None
    config = CacheConfig.from_kwargs(**cache, sparse=0.03)
    state, _ = abstract_pool_state(config, devices)
    sparse, spec = state.sparse, state.spec
    layout = SummaryLayout(spec)
    assert sparse.config == config.sparse
    assert sparse.summaries.shape == layout.shape and sparse.summaries.dtype == layout.dtype
    assert sparse.summaries.sharding.memory_kind == "pinned_host"
    assert sparse.previous.shape == PoolSparseState.previous_shape(config.sparse, spec)
    assert sparse.staged_chunk.shape == (layout.chunk_blocks, layout.row_width)
    assert sparse.staged_chunk.sharding.memory_kind != "pinned_host"
    assert sparse.staged_layer.shape == () and sparse.counts.dtype == jnp.int32


def test_a_sparse_plan_says_its_selection_and_summary_copies():
    from jax_tpusync.tpu import SparseContextPlan

    def sparse_part(context_blocks, selected, spanning, copies):
        return SparseContextPlan(
            context_blocks=context_blocks, selected_blocks=selected,
            summary_layer_bytes=context_blocks << 10, summary_chunk_blocks=512,
            summary_host_bytes=context_blocks << 11,
            summary_overlap=dict(
                computations=1, copies=copies, started_before=0, overlapped=0,
                spanning=spanning,
            ),
        )  # fmt: skip

    plan = step_plan(
        context_plan(131072, sparse=sparse_part(512, 16, 2, 2)),
        context_plan(1 << 20, sparse=sparse_part(4096, 123, 3, 16)),
    )
    data = plan.to_dict()
    assert data["contexts"][1]["sparse"]["selected_blocks"] == 123
    assert data["contexts"][1]["sparse"]["summary_overlap"]["spanning"] == 3
    assert (
        "  sparse decode: blocks selected per slot and layer 16 of 512 at 128K; 123 of 4096 at"
        " 1M; summaries in host memory 8 MiB at 1M; 5 of 18 summary chunk copies have an"
        " attention, a layer's unit walk or a scoring between their start and their end (the"
        " projected times below are the dense step's)"
    ) in plan.summary().splitlines()
    assert "sparse decode" not in step_plan(context_plan()).summary()
