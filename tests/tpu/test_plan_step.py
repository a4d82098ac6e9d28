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
    if topology == "v6e:2x2":
        requests.append("gemma_hybrid@32768,1048576")
    requests += ["slots_24@4096", "slots_32@4096"]
    return topology, plans_for(tmp_path_factory, topology, *requests)


@pytest.mark.slow
def test_every_unit_copy_overlaps_an_attention_for_steps_unlike_the_benchs(generation):
    topology, plans = generation
    plans = {name: plan for name, plan in plans.items() if name in MODELS}
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


@pytest.mark.slow
@pytest.mark.parametrize("name, slots, group", [("slots_24", 24, 12), ("slots_32", 32, 16)])
def test_more_slots_than_one_units_copies_hold_overlap_every_copy(generation, name, slots, group):
    """Past 16 slots a chip one block a slot passes the 32 copies in flight: the layer
    walks each unit two groups of slots at a time, one block a slot, and every copy of
    every group overlaps an attention on each generation."""
    topology, plans = generation
    plan = plans[name]
    (c,) = plan["contexts"]
    assert c["context"] == 4096 and c["chunk_len"] == BLOCK_TOKENS_WIDE[name], c
    # A group's unit: a block and a tail per slot of the group, within the 32 in flight.
    assert c["unit_copies"] == group * 2 <= 32, c
    assert c["computations"] == 1 and c["copies"] == c["unit_copies"], (topology, c)
    assert c["overlapped"] == c["started_before"] == c["copies"], (topology, c)
    assert plan["all_overlapped"] is True, plan["summary"]
    # The staging is whole units of every slot, as below 16.
    assert c["staging_bytes"] == 2 * slots * (c["chunk_len"] + 2) * ROW_BYTES_WIDE[name]


BLOCK_TOKENS_WIDE = dict(slots_24=256, slots_32=128)
ROW_BYTES_WIDE = dict(slots_24=2 * 2 * 64 * 2, slots_32=2 * 1 * 128 * 2)  # K and V, bf16.


@pytest.mark.slow
def test_a_users_hybrid_host_pool_cache_is_planned_per_group_flat_and_overlapped(generation):
    """A Gemma-3-like model (five sliding layers of 512 tokens to one global) whose cache
    is a HybridKVCache(host_pool=True): the sliding group keeps a ring of its window per
    slot, so the device memory and that group's pool are the same at 32K and 1M tokens,
    and every unit copy of both groups overlaps an attention."""
    topology, plans = generation
    if topology != "v6e:2x2":
        pytest.skip("planned on v6e only (two more compiles)")
    plan = plans["gemma_hybrid"]
    assert plan["chips"] == 1 and plan["all_overlapped"] is True, plan["summary"]
    assert plan["device_bytes_flat"] is True, plan["summary"]
    short, long = plan["contexts"]
    assert abs(long["device_bytes"] - short["device_bytes"]) <= 0.01 * short["device_bytes"]
    per_token = 2 * 2 * 2 * 128 * 2  # 2 slots x K and V x 2 KV heads x 128, bf16.
    for c in (short, long):
        sliding, global_ = c["groups"]
        assert sliding["layers"] == [0, 1, 2, 3, 4] and sliding["window"] == 512
        assert sliding["ring_blocks"] > 0 and sliding["readers"] == []
        assert global_["layers"] == [5] and global_["window"] is None
        assert global_["ring_blocks"] == 0
        # One unit loop per layer, each unit copied a unit ahead of its attention.
        assert c["computations"] == 6, c
        assert c["copies"] == 5 * sliding["unit_copies"] + global_["unit_copies"], c
        assert c["overlapped"] == c["started_before"] == c["copies"], c
        assert c["staging_bytes"] == sliding["staging_bytes"] + global_["staging_bytes"]
        assert c["pool_bytes"] == sliding["pool_bytes"] + global_["pool_bytes"]
        assert c["step_copy_bytes"] == sliding["step_copy_bytes"] + global_["step_copy_bytes"]
        assert c["unit_copies"] == max(sliding["unit_copies"], global_["unit_copies"]) <= 32
        assert c["device_bytes"] <= bounded(c), c
        # Resident: each sliding layer holds its window, the global one every token.
        assert c["resident_bytes"] == c["weights_bytes"] + (5 * 512 + c["context"]) * per_token
    # The rings do not grow with the context; the global pool does, 32-fold.
    assert long["groups"][0]["pool_bytes"] == short["groups"][0]["pool_bytes"]
    assert long["groups"][0]["step_copy_bytes"] == short["groups"][0]["step_copy_bytes"]
    assert long["groups"][1]["pool_bytes"] == pytest.approx(
        32 * short["groups"][1]["pool_bytes"], rel=0.01
    )
    lines = plan["summary"].splitlines()
    assert " at every context (32K and 1M tokens; weights " in lines[1]
    assert lines[3].startswith("  the pools in host memory: ")
    assert lines[4].startswith(
        "  layer group 0: layers 0, 1, 2, 3, 4, 2 KV heads x 128, sliding window 512, a ring"
        " of "
    )
    assert lines[5].startswith("  layer group 1: layers 5, 2 KV heads x 128, global: units of ")


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


HYBRID = dict(
    num_layers=3, batch=2, num_kv_heads=2, head_dim=64, dtype="bfloat16", block_tokens=256,
    sliding_window=[512, 512, None], host_pool=True, max_step_tokens=1,
)  # fmt: skip


def test_a_hybrid_caches_bad_inputs_are_refused_by_name_before_anything_compiles():
    import jax
    import jax.numpy as jnp

    from jax_tpusync.runtime.engine import EngineConfig
    from jax_tpusync.tpu import plan_step

    params = [dict(w=jax.ShapeDtypeStruct((8, 8), jnp.bfloat16))]

    def plan(cache, **options):
        return plan_step(lambda p, s: (p, s), params, cache, topology="no-such:1x1", **options)

    # Each refusal comes before the topology is looked up (a topology no libtpu knows).
    with pytest.raises(ValueError, match=r"mesh_axes=\{'x': 1\} with a hybrid cache"):
        plan(HYBRID, mesh_axes={"x": 1})
    with pytest.raises(ValueError, match=r"sparse=0.03 with a hybrid cache"):
        plan(dict(HYBRID, sparse=0.03))
    with pytest.raises(ValueError, match=r"host_pool=False plans an engine cache"):
        plan(dict(HYBRID, host_pool=False))
    with pytest.raises(ValueError, match=r"engine=EngineConfig: host-pool groups"):
        plan(dict(HYBRID, engine=EngineConfig()))
    with pytest.raises(ValueError, match=r"kv_sharing\[1\]=1: a layer reads the KV of an"):
        plan(dict(HYBRID, kv_sharing=[None, 1, None]))
    with pytest.raises(ValueError, match=r"max_step_tokens=0 must be an int in \[1, max_len"):
        plan(dict(HYBRID, max_step_tokens=0))
    with pytest.raises(ValueError, match=r"num_kv_heads has 2 entries for 3 layers"):
        plan(dict(HYBRID, num_kv_heads=[2, 2]))
    with pytest.raises(ValueError, match=r"head_dim is missing"):
        plan({k: v for k, v in HYBRID.items() if k != "head_dim"})
    with pytest.raises(ValueError, match=r"mesh= is the planner's to give"):
        plan(dict(HYBRID, mesh=object()))
    # At each edge: sparse None, a step of one row, host_pool=True, a layer reading an
    # earlier one of its geometry pass the checks plan_step makes before compiling.
    from jax_tpusync.caches.hybrid.config import host_pool_groups

    fine = dict(HYBRID, sparse=None, kv_sharing=[None, 0, None])
    groups, configs, _, _ = host_pool_groups(fine, max_len=32768)
    assert groups.source_of == (None, 0, None) and len(configs) == 2


def test_which_keywords_plan_a_hybrid_cache():
    from jax_tpusync.tpu.plan import _hybrid_keywords

    one = dict(num_layers=3, batch=2, num_kv_heads=2, head_dim=64)
    assert _hybrid_keywords(one) is None
    # Mixed windows alone: one pool that keeps every position, as before.
    assert _hybrid_keywords(dict(one, sliding_window=[512, 512, None])) is None
    assert _hybrid_keywords(dict(one, sliding_window=[512, None], bound_windows=False)) is None
    for hybrid in (
        dict(one, host_pool=True),
        dict(one, bound_windows=True),
        dict(one, kv_sharing=[None, 0, None]),
        dict(one, window_cache_blocks=0),
        dict(one, num_kv_heads=[2, 2, 4]),
        dict(one, head_dim=(64, 64, 128)),
        dict(one, num_kv_heads=[2, 2, 4], bound_windows=False),
    ):
        assert _hybrid_keywords(hybrid) == hybrid
    from jax_tpusync.core.config import CacheConfig

    assert _hybrid_keywords(CacheConfig.from_kwargs(**one, max_len=1024)) is None


def test_a_hybrid_caches_abstract_state_is_every_groups_pool_state_as_shapes():
    import jax
    import jax.numpy as jnp

    from jax_tpusync.caches.hybrid.config import host_pool_groups
    from jax_tpusync.core.pool_state import PoolLayout
    from jax_tpusync.tpu.abstract_state import abstract_hybrid_state

    keywords = dict(HYBRID, kv_sharing=[None, 0, None], max_step_tokens=4)
    plan, configs, step_tokens, dtype = host_pool_groups(keywords, max_len=32768)
    assert step_tokens == 4 and dtype == jnp.bfloat16 and len(configs) == 2
    state, on_device = abstract_hybrid_state(plan, configs, step_tokens, dtype, jax.devices()[0])
    sliding, global_ = state.groups
    assert sliding.spec.ring_blocks > 0 and not global_.spec.ring_blocks
    for part in state.groups:
        assert part.pool.shape == PoolLayout(part.spec).pool_shape
        assert part.pool.sharding.memory_kind == "pinned_host"
        assert part.staging.sharding == on_device
    # Layer 1 reads layer 0: its rows of the step, [2, batch, max_step_tokens, heads, dim].
    (pending,) = state.pending
    assert pending.shape == (2, 2, 4, 2, 64) and pending.dtype == jnp.bfloat16
    assert state.step_lengths.shape == (2,)
    # Its sliding group's pool is the same at 1M tokens: rings, not positions.
    _, long_configs, _, _ = host_pool_groups(keywords, max_len=1 << 20)
    long_state, _ = abstract_hybrid_state(plan, long_configs, 4, dtype, jax.devices()[0])
    assert long_state.groups[0].pool.shape == sliding.pool.shape
    assert long_state.groups[1].pool.shape[0] > 30 * global_.pool.shape[0]


def test_a_hybrid_plan_says_each_group_in_words():
    from jax_tpusync.tpu import GroupPlan

    def group(layers, window, ring, readers=()):
        return GroupPlan(
            layers=layers, readers=readers, num_kv_heads=2, head_dim=128, window=window,
            ring_blocks=ring, chunk_len=768, unit_copies=8, staging_bytes=3 << 20,
            pool_bytes=15 << 20, resident_kv_bytes=1 << 20, step_copy_bytes=1 << 20,
        )  # fmt: skip

    groups = (group((0, 1), 512, 3, readers=(2,)), group((3,), None, 0), group((4,), 256, 0))
    text = step_plan(context_plan(groups=groups)).summary().splitlines()
    assert text[3] == "  the pools in host memory: 32 MiB at 32K"
    assert text[4:7] == [
        "  layer group 0: layers 0, 1 (read by 2), 2 KV heads x 128, sliding window 512, a"
        " ring of 3 blocks per slot: units of 768 tokens (8 copies each), staging 3 MiB, pool"
        " 15 MiB at 32K",
        "  layer group 1: layers 3, 2 KV heads x 128, global: units of 768 tokens (8 copies"
        " each), staging 3 MiB, pool 15 MiB at 32K",
        "  layer group 2: layers 4, 2 KV heads x 128, sliding window 256, every position kept:"
        " units of 768 tokens (8 copies each), staging 3 MiB, pool 15 MiB at 32K",
    ]
    assert step_plan(context_plan()).summary().splitlines()[3].startswith("  the pool in host")


def test_a_hybrid_plan_holds_the_groups_the_hybrid_cache_makes():
    """What plan_step compiles is the cache HybridKVCache(host_pool=True) makes of the same
    keywords: each group's configuration and spec (one device's)."""
    import jax
    import jax.numpy as jnp

    import jax_tpusync as tps
    from jax_tpusync.caches.hybrid.config import host_pool_groups
    from jax_tpusync.tpu.abstract_state import abstract_pool_state

    keywords = dict(HYBRID, max_len=4096, kv_sharing=[None, 0, None], dtype=jnp.float32)
    cache = tps.HybridKVCache(**keywords)
    try:
        plan, configs, step_tokens, _ = host_pool_groups(keywords)
        assert plan == cache.plan and step_tokens == cache.max_step_tokens
        assert configs == [group.config for group in cache.groups]
        for config, group in zip(configs, cache.groups):
            state, _ = abstract_pool_state(config, jax.devices())
            assert state.spec == group.spec
    finally:
        cache.close()
