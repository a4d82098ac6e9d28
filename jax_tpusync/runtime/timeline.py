"""Seeing where a decode step's time goes: engine timelines as Chrome traces and plots.

Record with ``EngineConfig(record_timeline=True)``, bracket each layer's compute in the jitted
step with :func:`jax_tpusync.runtime.ops.mark` (``MARK_COMPUTE_BEGIN`` on the layer's input,
``MARK_COMPUTE_END`` on its output, tag ``(layer, -1)``), then take ``engine.timeline()``:

* :func:`write_chrome_trace` writes Chrome/Perfetto trace JSON (``chrome://tracing`` or
  https://ui.perfetto.dev): one track per engine direction and worker lane, one for compute,
  one for waits. Times are ``CLOCK_MONOTONIC`` microseconds, so the file can be opened next to
  a JAX profiler trace of the same run.
* :func:`plot` draws, per layer, the fetch bars, the compute bars and the waits that
  stalled the step, on one time axis (matplotlib; PNG or anything ``savefig`` writes).
* :func:`summarize` reduces a timeline to a few numbers (stalls, busy times, per layer).
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Sequence
from typing import Any

from jax_tpusync.runtime.engine import Timeline

MARK_COMPUTE_BEGIN = 1  # Same values as jax_tpusync.runtime.ops (kept here to avoid importing jax).
MARK_COMPUTE_END = 2
DEFAULT_STALL_NS = 100_000  # A wait longer than 0.1 ms stalled the step.

_DIRECTIONS = {0: "fetch", 1: "write-back"}


@dataclasses.dataclass(frozen=True)
class Span:
    """One interval of a timeline, in monotonic nanoseconds."""

    kind: str  # "fetch", "write-back", "compute", "wait"
    begin_ns: int
    end_ns: int
    layer: int
    chunk: int
    args: dict[str, Any] = dataclasses.field(default_factory=dict)

    @property
    def dur_ns(self) -> int:
        return max(0, self.end_ns - self.begin_ns)


def _as_timeline(timeline: Timeline | dict) -> Timeline:
    if isinstance(timeline, Timeline):
        return timeline
    return Timeline(
        transfers=list(timeline.get("transfers", ())),
        waits=list(timeline.get("waits", ())),
        marks=list(timeline.get("marks", ())),
    )


def spans(timeline: Timeline | dict) -> list[Span]:
    """All transfers, waits and compute spans (paired marks), sorted by begin time."""
    tl = _as_timeline(timeline)
    out: list[Span] = []
    for (
        ticket,
        tier,
        direction,
        layer,
        chunk,
        nbytes,
        submit_ns,
        start_ns,
        end_ns,
        ok,
    ) in tl.transfers:
        out.append(
            Span(
                _DIRECTIONS.get(int(direction), f"dir{direction}"),
                int(start_ns),
                int(end_ns),
                int(layer),
                int(chunk),
                dict(
                    ticket=int(ticket),
                    tier=int(tier),
                    bytes=int(nbytes),
                    queued_us=(int(start_ns) - int(submit_ns)) / 1e3,
                    ok=bool(ok),
                ),
            )
        )
    for ticket, layer, chunk, begin_ns, end_ns in tl.waits:
        out.append(
            Span(
                "wait", int(begin_ns), int(end_ns), int(layer), int(chunk), dict(ticket=int(ticket))
            )
        )
    open_marks: dict[tuple[int, int], list[int]] = {}
    for kind, layer, chunk, ns in sorted(tl.marks, key=lambda m: m[3]):
        key = (int(layer), int(chunk))
        if kind == MARK_COMPUTE_BEGIN:
            open_marks.setdefault(key, []).append(int(ns))
        elif kind == MARK_COMPUTE_END and open_marks.get(key):
            begin = open_marks[key].pop(0)
            out.append(Span("compute", begin, int(ns), key[0], key[1]))
    out.sort(key=lambda s: (s.begin_ns, s.end_ns))
    return out


def step_starts(timeline: Timeline | dict) -> list[int]:
    """Begin times of the steps: the compute-begin marks of the first layer seen."""
    begins = [s for s in spans(timeline) if s.kind == "compute"]
    if not begins:
        return []
    first_layer = min(s.layer for s in begins)
    return [s.begin_ns for s in begins if s.layer == first_layer]


def _lanes(items: Sequence[Span]) -> list[int]:
    """Assigns overlapping spans to lanes (0, 1, ...) so no two on a lane overlap."""
    ends: list[int] = []
    lanes = []
    for s in items:
        for i, end in enumerate(ends):
            if end <= s.begin_ns:
                ends[i] = s.end_ns
                lanes.append(i)
                break
        else:
            ends.append(s.end_ns)
            lanes.append(len(ends) - 1)
    return lanes


def chrome_trace(
    timeline: Timeline | dict,
    *,
    pid: int | None = None,
    process_name: str = "jax_tpusync engine",
    stall_ns: int = DEFAULT_STALL_NS,
) -> dict[str, Any]:
    """The trace as a dict ``{"traceEvents": [...], "displayTimeUnit": "ms"}``."""
    pid = os.getpid() if pid is None else pid
    all_spans = spans(timeline)
    events: list[dict[str, Any]] = [
        dict(ph="M", pid=pid, name="process_name", args=dict(name=process_name))
    ]
    tracks: dict[str, int] = {}

    def tid(name: str) -> int:
        if name not in tracks:
            tracks[name] = 1000 + len(tracks)
            events.append(
                dict(ph="M", pid=pid, tid=tracks[name], name="thread_name", args=dict(name=name))
            )
            events.append(
                dict(
                    ph="M",
                    pid=pid,
                    tid=tracks[name],
                    name="thread_sort_index",
                    args=dict(sort_index=len(tracks)),
                )
            )
        return tracks[name]

    for kind in ("compute", "wait", "fetch", "write-back"):
        group = [s for s in all_spans if s.kind == kind]
        lanes = _lanes(group) if kind in ("fetch", "write-back") else [0] * len(group)
        for s, lane in zip(group, lanes):
            track = kind if kind in ("compute", "wait") else f"{kind} {lane}"
            args = dict(layer=s.layer, chunk=s.chunk, **s.args)
            name = f"{kind} L{s.layer}" + (f" c{s.chunk}" if s.chunk >= 0 else "")
            if kind == "wait":
                args["stalled"] = s.dur_ns > stall_ns
                name = ("stall " if s.dur_ns > stall_ns else "wait ") + name[5:]
            if "bytes" in args and s.dur_ns > 0:
                args["gbps"] = round(args["bytes"] / s.dur_ns, 3)
            events.append(
                dict(
                    ph="X",
                    pid=pid,
                    tid=tid(track),
                    name=name,
                    cat=kind,
                    ts=s.begin_ns / 1e3,
                    dur=s.dur_ns / 1e3,
                    args=args,
                )
            )
    return {"traceEvents": events, "displayTimeUnit": "ms"}


def write_chrome_trace(timeline: Timeline | dict, path: str | os.PathLike, **kwargs) -> str:
    """Writes the timeline as Chrome/Perfetto trace JSON to ``path``; returns the path."""
    path = os.fspath(path)
    with open(path, "w") as f:
        json.dump(chrome_trace(timeline, **kwargs), f)
    return path


def _window(all_spans: list[Span], starts: list[int], last_steps: int | None):
    if not all_spans:
        return 0, 0
    lo = min(s.begin_ns for s in all_spans)
    hi = max(s.end_ns for s in all_spans)
    if last_steps and len(starts) > last_steps:
        lo = starts[-last_steps]
    return lo, hi


def summarize(timeline: Timeline | dict, *, stall_ns: int = DEFAULT_STALL_NS) -> dict[str, Any]:
    """Counts and per-layer means (ms per step) of fetch, compute and stalled-wait time."""
    all_spans = spans(timeline)
    steps = max(1, len(step_starts(timeline)))
    layers = sorted({s.layer for s in all_spans if s.layer >= 0})
    per_layer = {}
    for layer in layers:
        mine = [s for s in all_spans if s.layer == layer]
        per_layer[str(layer)] = dict(
            fetch_ms=sum(s.dur_ns for s in mine if s.kind == "fetch") / 1e6 / steps,
            compute_ms=sum(s.dur_ns for s in mine if s.kind == "compute") / 1e6 / steps,
            stall_ms=sum(s.dur_ns for s in mine if s.kind == "wait" and s.dur_ns > stall_ns)
            / 1e6
            / steps,
        )
    waits = [s for s in all_spans if s.kind == "wait"]
    stalls = [s for s in waits if s.dur_ns > stall_ns]
    fetches = [s for s in all_spans if s.kind == "fetch"]
    return dict(
        steps=steps,
        transfers=sum(1 for s in all_spans if s.kind in _DIRECTIONS.values()),
        fetch_bytes=sum(s.args.get("bytes", 0) for s in fetches),
        waits=len(waits),
        stalled_waits=len(stalls),
        stall_ms_per_step=sum(s.dur_ns for s in stalls) / 1e6 / steps,
        compute_ms_per_step=sum(s.dur_ns for s in all_spans if s.kind == "compute") / 1e6 / steps,
        per_layer=per_layer,
    )


def plot(
    timeline: Timeline | dict,
    path: str | os.PathLike,
    *,
    title: str | None = None,
    stall_ns: int = DEFAULT_STALL_NS,
    last_steps: int | None = None,
) -> str:
    """Draws per-layer fetch, compute and stalled-wait bars on a time axis; saves to ``path``.

    Args:
      timeline: from ``engine.timeline()`` (with compute marks for the compute bars).
      path: output image (the extension picks the format, e.g. ``.png``).
      title: figure title.
      stall_ns: waits longer than this are drawn as stalls.
      last_steps: only show the last N steps (by layer-0 compute marks); None: everything.
    """
    import matplotlib

    if matplotlib.get_backend().lower() not in ("agg", "pdf", "svg", "cairo"):
        matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    all_spans = spans(timeline)
    starts = step_starts(timeline)
    lo, hi = _window(all_spans, starts, last_steps)
    shown = [s for s in all_spans if s.end_ns >= lo and s.begin_ns <= hi]
    layers = sorted({s.layer for s in shown if s.layer >= 0}) or [0]
    row = {layer: i for i, layer in enumerate(layers)}
    ms = lambda ns: (ns - lo) / 1e6

    colors = {
        "fetch": "#4C72B0",
        "write-back": "#DD8452",
        "compute": "#55A868",
        "stall": "#C44E52",
        "wait": "#BBBBBB",
    }
    height = max(3.0, 0.75 * len(layers) + 1.8)
    fig, (ax, bx) = plt.subplots(
        1, 2, figsize=(15, height), width_ratios=[4, 1], layout="constrained"
    )
    # Each layer row: fetch lane on top, compute lane (with stalls over it) below.
    for kind in ("fetch", "write-back", "compute", "wait"):
        group = [s for s in shown if s.kind == kind and s.layer in row]
        for s in group:
            y = row[s.layer]
            if kind in ("fetch", "write-back"):
                y0, h = y - 0.43, 0.38  # Upper lane (the y axis is inverted).
                color = colors[kind]
            elif kind == "compute":
                y0, h = y + 0.05, 0.38
                color = colors["compute"]
            else:
                stalled = s.dur_ns > stall_ns
                if not stalled:
                    continue
                y0, h = y + 0.01, 0.46
                color = colors["stall"]
            ax.broken_barh(
                [(ms(s.begin_ns), max(s.dur_ns / 1e6, 0.02))],
                (y0, h),
                facecolors=color,
                edgecolors="white",
                linewidth=0.3,
                alpha=0.95 if kind != "fetch" else 0.85,
            )
    for t in starts:
        if lo <= t <= hi:
            ax.axvline(ms(t), color="black", linestyle=":", linewidth=0.8)
    ax.set_yticks(range(len(layers)), [f"layer {layer}" for layer in layers])
    ax.set_ylim(-0.6, len(layers) - 0.4)
    ax.invert_yaxis()
    ax.set_xlim(0, max(ms(hi), 1e-3) * 1.01)
    ax.set_xlabel("time (ms); dotted lines: step starts")
    ax.grid(axis="x", alpha=0.3)
    ax.legend(
        handles=[
            Patch(color=colors["fetch"], label="fetch (upper lane, by layer fetched)"),
            Patch(color=colors["write-back"], label="write-back"),
            Patch(color=colors["compute"], label="layer compute (lower lane)"),
            Patch(color=colors["stall"], label=f"wait that stalled (> {stall_ns / 1e6:g} ms)"),
        ],
        loc="upper center",
        bbox_to_anchor=(0.5, -0.12 if len(layers) > 2 else -0.25),
        ncol=4,
        fontsize=8,
        frameon=False,
    )
    ax.set_title(title or "engine timeline", fontsize=10, loc="left")

    # Per-layer totals over the shown window, per step.
    steps_shown = max(1, sum(1 for t in starts if lo <= t <= hi))
    width = 0.27
    for j, (kind, label) in enumerate(
        (("fetch", "fetch"), ("compute", "compute"), ("stall", "stalled"))
    ):
        vals = []
        for layer in layers:
            mine = [s for s in shown if s.layer == layer]
            if kind == "stall":
                total = sum(s.dur_ns for s in mine if s.kind == "wait" and s.dur_ns > stall_ns)
            else:
                total = sum(s.dur_ns for s in mine if s.kind == kind)
            vals.append(total / 1e6 / steps_shown)
        bx.barh(
            [i + (j - 1) * width for i in range(len(layers))],
            vals,
            height=width,
            color=colors[kind],
            label=label,
        )
    bx.set_yticks(range(len(layers)), [f"L{layer}" for layer in layers])
    bx.set_ylim(-0.6, len(layers) - 0.4)
    bx.invert_yaxis()
    bx.set_xlabel("ms per step (fetch: busy time,\nsummed over parallel transfers)", fontsize=8)
    bx.set_title("per layer", fontsize=10)
    bx.legend(fontsize=8, loc="lower right")
    bx.grid(axis="x", alpha=0.3)
    path = os.fspath(path)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
