"""The host-pool decode step compiled for a TPU (libtpu's compiler; nothing runs).

``python -m jax_tpusync.bench tpu-compile`` in a child process (libtpu reads its settings
when JAX starts): the step must compile for a v5e with the Pallas attention kernel through
Mosaic, hold the same device memory at 32K and 1M tokens (weights plus its staging), start
every unit copy before the attention it overlaps, and beat the plain memory-kinds step,
which keeps every layer's KV on the device.
"""

from __future__ import annotations

import importlib.util
import json
import os
import platform
import subprocess
import sys

import pytest

from support import child_env

# libtpu's wheels are Linux x86_64 only: there the test extra installs it, and a missing
# one is a failure, not a skip.
REQUIRED = sys.platform == "linux" and platform.machine() == "x86_64"


def compile_report(tmp_path_factory, *args: str) -> dict:
    """``bench tpu-compile *args``'s rows by context, run in a child process."""
    if importlib.util.find_spec("libtpu") is None:
        if REQUIRED:
            pytest.fail("libtpu is not installed: pip install '.[test]' installs it here")
        pytest.skip("libtpu has no wheel for this platform")
    out = tmp_path_factory.mktemp("tpu") / "tpu_compile.json"
    command = [sys.executable, "-m", "jax_tpusync.bench", "tpu-compile", *args, "--json", str(out)]
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    # Not the source tree, whose package has no built extension.
    done = subprocess.run(
        command, capture_output=True, text=True, env=env, timeout=900, cwd=out.parent
    )
    assert done.returncode == 0, done.stderr[-3000:]
    # The summary in words, not the table (--details), and no empty cell printed.
    assert "Nothing ran on a TPU: " in done.stdout and "ours holds " in done.stdout
    assert "None" not in done.stdout and "nan" not in done.stdout
    assert "ours MiB" not in done.stdout
    return {row["context"]: row for row in json.loads(out.read_text())["results"]}


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    return compile_report(
        tmp_path_factory, "--topologies", "v5e:2x2", "--contexts", "32768", "1048576",
        "--layers", "4", "--kinds", "ours", "plain",
    )  # fmt: skip


@pytest.mark.slow
def test_device_memory_is_weights_plus_staging_at_any_context(report):
    short, long = report[32768], report[1048576]
    for row in (short, long):
        assert row["ours_device_mib"] <= 1.1 * (row["weights_mib"] + row["staging_mib"]), row
        assert row["ran_on_tpu"] is False
    assert (
        abs(long["ours_device_mib"] - short["ours_device_mib"]) <= 0.01 * short["ours_device_mib"]
    )


@pytest.mark.slow
def test_plain_memory_kinds_keep_every_layer_on_the_device(report):
    short = report[32768]
    assert short["plain_device_mib"] >= short["kv_mib_per_step"]  # Every layer's KV at once.
    long = report[1048576]
    # At 1M tokens its four layers need 16 GiB of KV, with the temporaries more than a
    # v5e's 16 GiB: refused by the compiler.
    assert long["plain_device_mib"] is None and "does not fit" in long["plain_note"]


@pytest.mark.slow
def test_a_pool_that_keeps_every_position_grows_with_the_context(report):
    short, long = report[32768], report[1048576]
    assert long["pool_mib"] == pytest.approx(32 * short["pool_mib"], rel=0.01)


@pytest.fixture(scope="module")
def ring_report(tmp_path_factory):
    """A model whose every layer slides over 16K tokens, its pool a ring per slot of the
    window plus one step's 512 rows (max_step_tokens), two units in flight ahead of the
    one attended (prefetch_depth=2), on a v6e, whose schedule overlaps fewer copies a unit
    at depth 1: one compile checks both (the ring's bytes, the deeper prefetch's
    overlap)."""
    return compile_report(
        tmp_path_factory,
        "--topologies", "v6e:2x2", "--contexts", "32768", "1048576", "--layers", "2",
        "--sliding-window", "16384", "--global-every", "0", "--max-step-tokens", "512",
        "--prefetch-depth", "2", "--kinds", "ours",
    )  # fmt: skip


@pytest.mark.slow
def test_a_ring_pool_holds_the_same_bytes_at_32k_and_1m(ring_report):
    short, long = ring_report[32768], ring_report[1048576]
    # Per layer and slot a ring of (16384 + 512 - 3) // 256 + 2 = 67 blocks of 256 rows (K
    # and V of 8 heads of 128 bf16 values: 4 KiB a row), and the sink block.
    ring_mib = (2 * 67 + 1) * 256 * 4096 / 2**20
    for row in (short, long):
        assert row["pool_mib"] == pytest.approx(ring_mib) and row["max_step_tokens"] == 512
        assert row["ours_device_mib"] <= 1.1 * (row["weights_mib"] + row["staging_mib"]), row
        overlap = row["overlap"]
        assert overlap["overlapped"] == overlap["started_before"] == overlap["copies"] > 0
    assert abs(long["ours_device_mib"] - short["ours_device_mib"]) <= 0.01 * long["ours_device_mib"]
    every_position_mib = 2 * 2**20 * 4096 / 2**20  # The pool at 1M tokens without the ring.
    assert long["pool_mib"] < every_position_mib / 50


@pytest.mark.slow
def test_two_units_ahead_overlap_every_copy_in_the_same_memory_at_32k_and_1m(ring_report):
    short, long = ring_report[32768], ring_report[1048576]
    for row in (short, long):
        # Three units in 64 MiB: 21 blocks of 256 tokens (4 KiB a token), within the 31 a
        # one-slot unit holds on any TPU (core.pool_state.unit_block_limit).
        assert row["prefetch_depth"] == 2 and row["chunk_len"] == 21 * 256
        assert row["staging_mib"] == pytest.approx(3 * (21 * 256 + 2) * 4096 / 2**20)
        assert row["ours_device_mib"] <= 1.1 * (row["weights_mib"] + row["staging_mib"]), row
        # Each layer's loop body copies the unit two ahead: every copy starts before the
        # body's attention and is waited for after it.
        overlap = row["overlap"]
        assert overlap["computations"] == 2 and overlap["copies"] == 2 * 22
        assert overlap["overlapped"] == overlap["started_before"] == overlap["copies"]
    assert abs(long["ours_device_mib"] - short["ours_device_mib"]) <= 0.01 * long["ours_device_mib"]


@pytest.mark.slow
def test_every_unit_copy_starts_before_the_attention_it_overlaps(report):
    for row in report.values():
        overlap = row["overlap"]
        assert overlap["computations"] == 4  # One unit loop per layer.
        assert overlap["started_before"] == overlap["copies"] > 0
        # Every copy is in flight across an attention (a unit holds no more blocks than
        # the schedule overlaps copies).
        assert overlap["overlapped"] == overlap["copies"]


@pytest.fixture(scope="module")
def mesh_report(tmp_path_factory):
    """A Gemma-3-like model (five sliding layers of 1024 tokens to one global) over the four
    chips of a v6e 2x2 as a 2 x 2 grid: its two slots split over one axis (the
    batch-sharded pool's layout), its KV heads over the other (each chip's pool in its host
    memory). Its units hold 31 blocks of a chip's one slot (the copies' limit); with units
    joined where they were copied, 6 blocks had this layout's global layer wait for its
    block copies before its attention (36 of 42 overlapped)."""
    return compile_report(
        tmp_path_factory,
        "--topologies", "v6e:2x2", "--contexts", "32768", "1048576", "--layers", "6",
        "--sliding-window", "1024", "--batch", "2", "--batch-over-chips", "--heads-over-chips",
        "--kinds", "ours",
    )  # fmt: skip


@pytest.mark.slow
def test_a_batch_by_heads_mesh_and_windowed_step_is_bounded_and_overlapped_on_v6e(mesh_report):
    short, long = mesh_report[32768], mesh_report[1048576]
    for row in (short, long):
        assert (row["chips"], row["dp"], row["tp"]) == (4, 2, 2)
        assert row["windows"] == [1024] * 5 + [None]
        # Per chip the weights split over the heads only: wq, wk, wv, wo of 6 layers, d_model
        # 4096, 8 KV heads of 128, bf16, halved.
        assert row["weights_mib"] == pytest.approx(6 * 2 * 4096 * (4096 + 1024) * 2 / 2 / 2**20)
        # The weights and the units: those the state stages and the one in flight (the
        # staging), and while a unit is attended its joined copy and the compiler's copy of
        # the staged one (305 MiB: 240 + 2.1 x 31; units of 31 blocks, where v6e's were 5
        # before a unit's copies stayed unjoined until attended, 1.1 x the two bounded it).
        assert row["ours_device_mib"] <= row["weights_mib"] + 2.5 * row["staging_mib"], row
        overlap = row["overlap"]
        assert overlap["computations"] == 6
        assert overlap["overlapped"] == overlap["started_before"] == overlap["copies"] > 0
    assert abs(long["ours_device_mib"] - short["ours_device_mib"]) <= 0.01 * long["ours_device_mib"]
    # Per chip, the sliding layers read their window, the global one every position: K and
    # V of one slot (2 over 2 chips) and 4 heads (8 over 2 chips) of 128 bf16 values a row.
    rows = 5 * 1024 + 2**20
    assert long["kv_mib_per_step"] == pytest.approx(2 * rows * 1 * 4 * 128 * 2 / 2**20)
    # Each chip's pool: its slot's and heads' blocks (every position kept), 32 times as many
    # at 1M as at 32K.
    assert long["pool_mib"] == pytest.approx(32 * short["pool_mib"], rel=0.01)


def test_the_summary_says_what_each_step_holds_in_words():
    from jax_tpusync.bench.tpu_compile import summary

    def row(context, ours, plain, plain_note="", resident_note="not compiled (--kinds)"):
        return dict(
            topology="v5e:2x2", context=context, implementation="pallas", chips=1, dp=1, tp=1,
            ours_device_mib=ours, plain_device_mib=plain, plain_note=plain_note,
            resident_device_mib=None, resident_note=resident_note, weights_mib=640.0,
            staging_mib=128.0, overlap=dict(computations=8, copies=16, overlapped=16),
            pool_mib=context / 16, max_step_tokens=None,
            link_gbps=23.75, projected_step_ms=0.5 * context / 2**15, ran_on_tpu=False,
        )  # fmt: skip

    text = summary(
        [
            row(32768, 770.2, 1795.6),
            row(1048576, 771.0, None, "does not fit: needs 33000 MiB of temporaries"),
        ]
    )
    assert text.splitlines() == [
        "v5e:2x2 (pallas attention), device memory per chip:",
        (
            "  ours holds 770 MiB at every context (32K and 1M tokens; weights 640 MiB"
            " + staging 128 MiB)"
        ),
        "  its pool in host memory: 2048-65536 MiB across the contexts",
        (
            "  plain memory kinds: hold 1796 MiB at 32K; do not fit at 1M (needs 33000 MiB of"
            " temporaries)"
        ),
        (
            "  32 of ours' 32 unit copies are started before the attention they overlap and"
            " waited for after it"
        ),
        (
            "  projected step time over a 23.75 GB/s host link per chip: 0.5 ms at 32K and"
            " 16.0 ms at 1M tokens"
        ),
        (
            "Nothing ran on a TPU: the memory is the compiler's plan; a step's time is only"
            " projected from the KV it reads over its generation's host link"
        ),
    ]
    # Ours growing past 1% reads as a range; an aborted compile is said, not printed empty.
    text = summary([row(32768, 700.0, None, "the compiler aborted: x"), row(65536, 800.0, 9.0)])
    assert "ours holds 700-800 MiB across the contexts (32K and 64K tokens;" in text
    assert "plain memory kinds: the compiler aborted at 32K; hold 9 MiB at 64K" in text
    assert summary([]) == "tpu-compile: nothing compiled"
    # Each topology says its own projection at each context, over its own link.
    two = [dict(row(2**15, 700.0, None), topology="v5e:2x2"), row(2**18, 700.0, None)]
    two += [
        dict(
            row(2**15, 700.0, None), topology="v6e:2x2", projected_step_ms=0.25,
            link_gbps=15.0, link_source="the v6e figure",
        )
    ]  # fmt: skip
    lines = summary(two).splitlines()
    v5e = "  projected step time over a 23.75 GB/s host link per chip: 0.5 ms at 32K and 4.0 ms at"
    assert lines.count(v5e + " 256K tokens") == 1
    v6e = "  projected step time over a 15.00 GB/s host link per chip (the v6e figure): 0.2 ms at"
    assert lines.count(v6e + " 32K tokens") == 1
    assert lines.index("v6e:2x2 (pallas attention), device memory per chip:") < lines.index(
        v6e + " 32K tokens"
    )
    split = [dict(row(32768, 700.0, None), chips=4, dp=2, tp=2)]
    assert summary(split).startswith(
        "v5e:2x2 (pallas attention, the slots split over 2 chips and the heads over 2), device"
    )
    assert "(pallas attention, the slots split over 4 chips)" in summary(
        [dict(split[0], dp=4, tp=1)]
    )
    ring = [dict(row(c, 700.0, None), pool_mib=135.0, max_step_tokens=512) for c in (2**15, 2**20)]
    assert (
        "  its pool in host memory: 135 MiB at every context, a ring of the window plus 512 "
        "rows per slot"
    ) in summary(ring).splitlines()


def test_the_chips_split_the_slots_by_the_heads_as_a_grid():
    from jax_tpusync.bench.tpu_compile import chip_split

    def split(chips, batch, heads):
        return chip_split(chips, batch_over_chips=batch, heads_over_chips=heads)

    assert split(4, True, True) == (2, 2)
    assert split(8, True, True) == (2, 4)
    assert split(16, True, True) == (4, 4)
    assert split(4, True, False) == (4, 1)
    assert split(4, False, True) == (1, 4)
    assert split(4, False, False) == (1, 1)


def test_a_split_the_chips_do_not_divide_is_refused_by_flag():
    import jax.numpy as jnp

    from jax_tpusync.bench.tiny_decoder import Shape
    from jax_tpusync.bench.tpu_compile import check_split

    def shape(batch, kv_heads):
        return Shape(
            layers=1, batch=batch, q_heads=16, kv_heads=kv_heads, head_dim=128, ffn=0,
            context=1024, dtype=jnp.bfloat16,
        )  # fmt: skip

    check_split(shape(2, 8), 2, 2)  # At the edge: one slot and four heads a chip.
    check_split(shape(4, 4), 4, 4)
    with pytest.raises(ValueError, match=r"--batch 3 must be a multiple of the 2 chips the slots"):
        check_split(shape(3, 8), 2, 2)
    with pytest.raises(ValueError, match=r"--batch 2 must be a multiple of the 4 chips"):
        check_split(shape(2, 8), 4, 1)
    with pytest.raises(ValueError, match=r"--kv-heads 6 must be a multiple of the 4 chips the KV"):
        check_split(shape(4, 6), 1, 4)


def test_a_refused_split_compiles_nothing(monkeypatch):
    """Every topology's split is checked before the first compile: a bad --batch costs no
    compile and no row."""
    from jax_tpusync.bench import __main__ as bench
    from jax_tpusync.bench import tpu_compile

    compiled = []
    monkeypatch.setattr(tpu_compile, "prepare_libtpu", lambda: None)
    monkeypatch.setattr(tpu_compile, "tpu_devices", lambda topology: [topology] * 4)
    monkeypatch.setattr(tpu_compile, "measure_in_child", lambda *a: compiled.append(a))
    args = bench.build_parser(["tpu-compile"]).parse_args(
        ["tpu-compile", "--batch", "3", "--batch-over-chips", "--heads-over-chips"]
    )
    assert args.batch_over_chips and args.heads_over_chips
    with pytest.raises(ValueError, match=r"--batch 3 must be a multiple of the 2 chips"):
        tpu_compile.run(args)
    assert compiled == []


def test_the_schedule_check_finds_a_copy_waited_for_too_early():
    from jax_tpusync.bench.tpu_compile import schedule_overlap

    start = '  %c = f32[8] dynamic-slice-start(%p), metadata={op_name="a/tpusync_fetch_unit/b"}'
    done = "  %d = f32[8] dynamic-slice-done(%c)"
    attend = '  %a = f32[8] fusion(%p), metadata={op_name="a/tpusync_attend_unit/b"}'

    def check(*lines):
        body = "\n".join(["%body (p: f32[]) -> f32[] {", *lines, "}"])
        return schedule_overlap(body, "tpusync_fetch_unit", "tpusync_attend_unit")

    assert check(start, attend, done) == dict(
        computations=1, copies=1, started_before=1, overlapped=1, spanning=1
    )
    assert check(start, done, attend)["overlapped"] == 0
    assert check(start, done, attend)["spanning"] == 0
    assert check(attend, start, done)["started_before"] == 0


def test_the_schedule_check_counts_copies_spanning_any_attention_scope_or_loop():
    """``spanning``: a copy with an attention of any of the scopes named (or, with
    ``loops=True``, a loop) between its start and its end, even where other attention
    comes before its start (a copy outside a loop, among other layers' attention)."""
    from jax_tpusync.tpu.schedule import schedule_overlap

    start = "  %c = u32[4,8]{1,0} copy-start(%p)"
    done = "  %d = u32[4,8]{1,0} copy-done(%c)"
    score = '  %s = f32[8] fusion(%p), metadata={op_name="a/tpusync_score_blocks/b"}'
    attend = '  %a = f32[8] fusion(%p), metadata={op_name="a/tpusync_attend_unit/b"}'
    walk = "  %w = (s32[], f32[8]) while(%t), condition=%cond, body=%body"

    def check(*lines, **options):
        body = "\n".join(["%main (p: f32[]) -> f32[] {", *lines, "}"])
        scopes = ("tpusync_score_blocks", "tpusync_attend_unit")
        return schedule_overlap(body, "u32[4,8]{", scopes, **options)

    # The scoring spans it: counted, though an attention came before its start.
    spans = check(attend, start, score, done)
    assert spans["spanning"] == 1 and spans["started_before"] == 0
    assert check(attend, start, done, score)["spanning"] == 0
    # A loop between start and end counts with loops=True only.
    assert check(attend, start, walk, done, loops=True)["spanning"] == 1
    assert check(attend, start, walk, done)["spanning"] == 0
    # One scope as a string still works.
    one = schedule_overlap(
        "\n".join(["%main (p: f32[]) -> f32[] {", start, attend, done, "}"]),
        "u32[4,8]{",
        "tpusync_attend_unit",
    )
    assert one["spanning"] == one["overlapped"] == 1


def test_the_schedule_check_counts_only_copies_whose_line_holds_every_text_named():
    """Several fetch texts: a copy's start line must hold them all. The summary chunk copies
    are named by their shape and their source's (the host array): the compiler's
    device-side slices of a copied chunk hold the chunk's shape but not the host array's."""
    from jax_tpusync.tpu.schedule import schedule_overlap

    host = (
        "  %c = ((u32[1025,1024]{1,0:S(5)}, s32[], s32[]), u32[64,1024]{1,0}, u32[])"
        " dynamic-slice-start(%h, %i, %j)"
    )
    host_done = "  %d = u32[64,1024]{1,0} dynamic-slice-done(%c)"
    device = "  %e = ((u32[64,1024]{1,0}), u32[16,1024]{1,0:S(1)}, s32[]) slice-start(%d)"
    device_done = "  %f = u32[16,1024]{1,0:S(1)} slice-done(%e)"
    score = '  %s = f32[8] fusion(%p), metadata={op_name="a/tpusync_score_blocks/b"}'
    body = "\n".join(
        ["%main (p: f32[]) -> f32[] {", host, device, score, host_done, device_done, "}"]
    )
    both = schedule_overlap(body, ("u32[64,1024]{", "u32[1025,1024]{"), "tpusync_score_blocks")
    assert both["copies"] == 1 and both["spanning"] == 1
    # By the chunk's shape alone the device slice counts too.
    assert schedule_overlap(body, "u32[64,1024]{", "tpusync_score_blocks")["copies"] == 2
    # A text no line holds: nothing.
    assert schedule_overlap(body, ("u32[64,1024]{", "u32[9,9]{"), "tpusync_score_blocks") == dict(
        computations=0, copies=0, started_before=0, overlapped=0, spanning=0
    )


@pytest.mark.slow
def test_the_example_models_step_compiles_bounded(tmp_path):
    """examples/model.py's Llama-style step, unchanged, with a host-pool state: compiled
    for a v5e at 32K and 1M tokens, its device memory the weights plus the staging."""
    if importlib.util.find_spec("libtpu") is None and not REQUIRED:
        pytest.skip("libtpu has no wheel for this platform")
    done = subprocess.run(
        [sys.executable, "-m", "support.compile_example_model", "v5e:2x2", "32768", "1048576"],
        capture_output=True, text=True, timeout=900, cwd=tmp_path,
        env=child_env(JAX_PLATFORMS="cpu"),
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    rows = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    assert [row["context"] for row in rows] == [32768, 1048576]
    for row in rows:
        assert row["device_mib"] <= 1.1 * (row["weights_mib"] + row["staging_mib"]), row
    assert abs(rows[1]["device_mib"] - rows[0]["device_mib"]) <= 0.01 * rows[0]["device_mib"]
