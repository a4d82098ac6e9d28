"""Entry point: ``python -m jax_tpusync.bench <subcommand> ... [--json OUT]``.

Each subcommand lives in its own module that exposes

* ``add_parser(subparsers)``: registers an argparse subparser, which sets the defaults
  ``run`` (``run(args) -> list[dict] | dict``) and ``columns`` (how to print result rows,
  see :func:`jax_tpusync.bench.common.format_table`; ``run`` may set it to None where it
  printed a summary of its own instead, as ``decode``, ``prefix``, ``pd``, ``hybrid``,
  ``serve``, ``prefill``, ``contention``, ``quality`` and ``tpu-compile`` do without
  ``--details``:
  :func:`jax_tpusync.bench.common.summary_or_details`);
* ``run(args)``: does the measurement and returns JSON-ready results.

To add a subcommand (e.g. ``decode``), write ``jax_tpusync/bench/decode.py`` with those two
functions and append ``"decode"`` to :data:`SUBCOMMANDS`. Modules are imported when the parser
is built, so keep heavy imports (``jax``) inside ``run`` where flags such as XLA_FLAGS must be
settled first.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence
from typing import Any

from jax_tpusync.bench import common

# Subcommand modules under jax_tpusync.bench, in --help order.
SUBCOMMANDS: tuple[str, ...] = (
    "transfer",
    "overlap",
    "decode",
    "contention",
    "prefix",
    "quality",
    "sparse",
    "retrieval",
    "serve",
    "prefill",
    "hybrid",
    "pd",
    "tpu-compile",
    "weights",
)


def build_parser(subcommands: Sequence[str] = SUBCOMMANDS) -> argparse.ArgumentParser:
    """Builds the CLI parser from the subcommand modules."""
    parser = argparse.ArgumentParser(
        prog="python -m jax_tpusync.bench",
        description="jax_tpusync benchmarks: engine vs a plain ceiling, measured side by side.",
        epilog="Every subcommand prints a table (decode, prefix, pd, hybrid, serve, prefill, "
        "contention, quality and tpu-compile: a short summary in words, the table with "
        "--details); --json OUT also writes the results as JSON (no file is written without it). "
        "'SUBCOMMAND --help' lists a subcommand's options.",
    )
    sub = parser.add_subparsers(dest="subcommand", required=True, metavar="SUBCOMMAND")
    for name in subcommands:
        module = importlib.import_module(f"jax_tpusync.bench.{name.replace('-', '_')}")
        module.add_parser(sub)
    return parser


def print_results(results: Any, columns: Sequence[tuple[str, str, str]] | None) -> None:
    """Prints result rows as a table (a dict result is printed as one row)."""
    rows = results if isinstance(results, list) else [results]
    if columns:
        print()
        print(common.format_table(rows, columns))


def main(argv: Sequence[str] | None = None) -> int:
    """Parses ``argv``, runs the subcommand, prints its table and writes its JSON where
    ``--json`` asks (nowhere without it)."""
    parser = build_parser()
    args = parser.parse_args(argv)
    results = args.run(args)
    print_results(results, getattr(args, "columns", None))
    common.report_json(args, args.subcommand, results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
