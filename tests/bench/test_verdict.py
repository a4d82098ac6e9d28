"""The benchmarks' plain-words comparisons and the decode benchmark's short summary."""

from __future__ import annotations

import pytest

from jax_tpusync.bench import decode_report, verdict


def test_spread_is_median_and_quartiles():
    s = verdict.Spread.of([1.0, 2.0, 3.0, 4.0, 5.0])
    assert (s.median, s.q1, s.q3, s.count) == (3.0, 2.0, 4.0, 5)
    assert s.iqr == 2.0
    assert verdict.Spread.of([7.0]).iqr == 0.0


@pytest.mark.parametrize("bad", [[], [1.0, 0.0], [1.0, float("nan")], [-2.0]])
def test_spread_refuses_what_is_not_a_step_time(bad):
    with pytest.raises(ValueError, match="samples_ms"):
        verdict.Spread.of(bad)


def test_a_clear_win_in_words():
    lib = verdict.Spread.of([10.0, 10.5, 11.0])
    jax = verdict.Spread.of([29.0, 30.0, 31.0])
    text = verdict.compare(lib, jax, "plain JAX (device_put in jit)")
    assert text == "2.9x faster than plain JAX (device_put in jit)"


def test_a_clear_loss_in_words():
    lib = verdict.Spread.of([12.0, 12.0, 12.0])
    jax = verdict.Spread.of([10.0, 10.0, 10.0])
    assert verdict.compare(lib, jax, "x") == "1.2x slower than x"


def test_within_noise_at_exactly_the_edge():
    """Medians 2 ms apart: an IQR of exactly 2 ms is noise, one just under is not."""
    edge = verdict.Spread.of([8.0, 9.0, 10.0, 11.0, 12.0])  # Median 10, IQR 2.0.
    other = verdict.Spread(median=12.0, q1=12.0, q3=12.0, count=3)
    assert verdict.within_noise(edge, other)
    text = verdict.compare(edge, other, "y")
    assert text.startswith("1.2x faster than y; within noise:")
    assert "differ by 2.0 ms" in text and "spread over 2.0 ms" in text
    just_under = verdict.Spread(median=12.0 + 1e-9, q1=12.0, q3=12.0, count=3)
    assert not verdict.within_noise(edge, just_under)
    assert "noise" not in verdict.compare(edge, just_under, "y")


def test_equal_medians_are_as_fast():
    a = verdict.Spread.of([5.0, 5.0])
    assert verdict.compare(a, a, "z").startswith("as fast as z; within noise:")


def _row(**samples):
    res = {"context": 32768, "tier": "file", "layers": 4, "kv_heads": 8, "head_dim": 64}
    res.update(dtype="bf16", batch=1)
    for name in ("prefetch", "resident_mode", "jax_offload", "plain_jax", "tuned_jax", "resident"):
        res[f"t_{name}_ms_samples"] = samples.get(name, [])
    return res


def test_decode_summary_names_the_faster_baseline_in_words():
    res = _row(
        prefetch=[10.0, 10.2, 10.4],
        jax_offload=[30.0, 31.0, 32.0],
        tuned_jax=[20.0, 20.5, 21.0],
        resident=[8.0, 8.1, 8.2],
    )
    text = decode_report.user_summary(res)
    assert "None" not in text
    assert "context 32K: file tier" in text
    assert "the library is 2.0x faster than plain JAX (memmap, next layer on a thread)" in text
    assert "the resident floor is 1.3x faster than the library" in text
    assert "plain JAX (device_put in jit)" in text  # Its row is in the table.
    assert "plain_jax" not in text and "1M" not in text
    assert "targets" not in text


def test_decode_summary_notes_a_floor_slower_than_the_library():
    noisy = _row(prefetch=[10.0, 10.1, 10.2], jax_offload=[30.0], resident=[9.0, 10.5, 12.0])
    text = decode_report.user_summary(noisy)
    assert "the resident floor is 1.04x slower than the library; within noise:" in text
    clear = _row(prefetch=[10.0, 10.1, 10.2], jax_offload=[30.0], resident=[15.0, 15.0, 15.0])
    text = decode_report.user_summary(clear)
    assert "1.5x slower than the library; a floor should not be slower" in text


def test_decode_summary_without_a_baseline_says_how_to_get_one():
    text = decode_report.user_summary(_row(prefetch=[10.0, 11.0]))
    assert "no plain-JAX baseline ran" in text and "faster" not in text


def test_a_table_prints_n_a_for_nan_and_a_dash_for_none():
    from jax_tpusync.bench import common

    columns = [("a", "a", ".1f"), ("b", "b", "d")]
    text = common.format_table([{"a": float("nan"), "b": None}], columns)
    assert text.splitlines()[-1].split() == ["n/a", "-"]
