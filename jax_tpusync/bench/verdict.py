"""Plain-words comparisons of a benchmark's step times: "2.9x faster than ...", with the spread.

A benchmark that compares the library with a baseline reports, per comparison, both steps'
median and interquartile range (IQR) over the timed samples, the ratio of the medians in
words, and "within noise" where the difference of the medians is no larger than the wider
of the two IQRs: on a shared machine such a difference says nothing about which is faster.
A floor (a step that cannot be beaten, such as all KV resident in device memory) is
reported the same way and called a floor.
"""

from __future__ import annotations

import dataclasses
import math
import statistics
from collections.abc import Sequence


@dataclasses.dataclass(frozen=True)
class Spread:
    """Median and quartiles of one step's timed samples, in milliseconds."""

    median: float
    q1: float
    q3: float
    count: int

    @property
    def iqr(self) -> float:
        """Interquartile range: the width of the middle half of the samples."""
        return self.q3 - self.q1

    @classmethod
    def of(cls, samples_ms: Sequence[float]) -> Spread:
        """The spread of ``samples_ms`` (one sample gives an IQR of 0).

        Raises:
          ValueError: ``samples_ms`` is empty or holds a value that is not a finite number > 0.
        """
        values = [float(v) for v in samples_ms]
        if not values:
            raise ValueError("samples_ms is empty: no timed step to summarize")
        bad = [v for v in values if not (math.isfinite(v) and v > 0)]
        if bad:
            raise ValueError(f"samples_ms must be finite step times > 0, got {bad[0]!r}")
        if len(values) == 1:
            return cls(values[0], values[0], values[0], 1)
        q1, _, q3 = statistics.quantiles(values, n=4, method="inclusive")
        return cls(statistics.median(values), q1, q3, len(values))

    def text(self) -> str:
        """``"12.3 ms (IQR 12.0-12.9)"``."""
        return f"{self.median:.1f} ms (IQR {self.q1:.1f}-{self.q3:.1f})"


def within_noise(a: Spread, b: Spread) -> bool:
    """Whether the difference of the medians is no larger than the wider of the two IQRs."""
    return abs(a.median - b.median) <= max(a.iqr, b.iqr)


def compare(subject: Spread, other: Spread, other_name: str) -> str:
    """``subject`` against ``other`` in words.

    Returns:
      ``"2.9x faster than <other_name>"``, ``"1.2x slower than <other_name>"`` or ``"as fast
      as <other_name>"`` (equal medians), followed by ``"; within noise: ..."`` where
      :func:`within_noise` holds.
    """
    if subject.median < other.median:
        words = f"{_times(other.median / subject.median)} faster than {other_name}"
    elif subject.median > other.median:
        words = f"{_times(subject.median / other.median)} slower than {other_name}"
    else:
        words = f"as fast as {other_name}"
    if within_noise(subject, other):
        words += (
            f"; within noise: the medians differ by {abs(subject.median - other.median):.1f} ms,"
            f" the samples spread over {max(subject.iqr, other.iqr):.1f} ms"
        )
    return words


def _ms(value: float) -> str:
    """Milliseconds, one decimal (``"12.3"``), none from 10 s on (``"12345"``)."""
    return f"{value:.0f}" if value >= 10_000 else f"{value:.1f}"


def _times(ratio: float) -> str:
    """``2.87`` -> ``"2.9x"``; under 1.1 two decimals, so that a small gap does not read 1.0x."""
    return f"{ratio:.2f}x" if ratio < 1.1 else f"{ratio:.1f}x"


def table(rows: Sequence[tuple[str, Spread]], what: str = "step") -> str:
    """An aligned table of ``(label, spread)`` rows: median and IQR in ms, sample count;
    ``what`` heads the labels' column."""
    head = (what, "median ms", "IQR ms", "samples")
    cells = [head] + [
        (label, _ms(s.median), f"{_ms(s.q1)}-{_ms(s.q3)}", str(s.count)) for label, s in rows
    ]
    widths = [max(len(c[i]) for c in cells) for i in range(len(head))]
    return "\n".join(
        "  "
        + "  ".join(c[0].ljust(widths[0]) if i == 0 else c[i].rjust(widths[i]) for i in range(4))
        for c in cells
    )


def plot_bars(rows: Sequence[tuple[str, Sequence[float]]], out: str, title: str) -> None:
    """A bar per ``(label, samples_ms)``: the median, whiskers from min to max, the samples
    as dots; written as a PNG to ``out``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 0.6 * len(rows) + 1.6))
    for i, (label, samples) in enumerate(rows):
        spread = Spread.of(samples)
        ax.barh(i, spread.median, color="tab:blue" if i == 0 else "tab:gray", alpha=0.7)
        ax.errorbar(
            spread.median,
            i,
            xerr=[[spread.median - min(samples)], [max(samples) - spread.median]],
            color="black",
            capsize=4,
        )
        ax.plot(list(samples), [i] * len(samples), "k.", markersize=3)
    ax.set_yticks(range(len(rows)), [label for label, _ in rows])
    ax.invert_yaxis()
    ax.set_xlabel("step time (ms): median, min-max, samples")
    ax.set_title(title, fontsize=9)
    ax.grid(True, axis="x", alpha=0.3)
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    plt.close(fig)
