"""The bench CLI's argument handling: ``--json`` is optional on every subcommand, and
without it the table is printed and no file is written."""

from __future__ import annotations

import json

import pytest

from jax_tpusync.bench import __main__ as bench_main
from jax_tpusync.bench import common

COLUMNS = [("rows", "rows", "d")]


@pytest.mark.parametrize("subcommand", bench_main.SUBCOMMANDS)
def test_every_subcommand_parses_without_json(subcommand):
    args = bench_main.build_parser().parse_args([subcommand])
    assert args.json is None
    assert bench_main.build_parser().parse_args([subcommand, "--json", "o.json"]).json == "o.json"


@pytest.mark.parametrize("subcommand", bench_main.SUBCOMMANDS)
def test_every_subcommand_help_says_json_is_optional(subcommand, capsys):
    with pytest.raises(SystemExit) as exit_info:
        bench_main.build_parser().parse_args([subcommand, "--help"])
    assert exit_info.value.code == 0
    help_text = " ".join(capsys.readouterr().out.split())
    assert "--json OUT" in help_text
    assert "without it the table is printed and no file is written" in help_text


def fake_parser():
    """A parser of one subcommand that measures nothing (so main() runs in no time)."""
    parser = bench_main.argparse.ArgumentParser(prog="bench")
    sub = parser.add_subparsers(dest="subcommand", required=True)
    p = sub.add_parser("fake")
    common.add_json_argument(p)
    p.set_defaults(run=lambda args: [{"rows": 3}], columns=COLUMNS)
    return parser


@pytest.fixture
def fake_main(monkeypatch, tmp_path):
    monkeypatch.setattr(bench_main, "build_parser", fake_parser)
    monkeypatch.chdir(tmp_path)
    return tmp_path


def test_main_without_json_prints_the_table_and_writes_nothing(fake_main, capsys):
    assert bench_main.main(["fake"]) == 0
    out = capsys.readouterr().out
    assert "rows" in out and "3" in out
    assert "wrote" not in out
    assert list(fake_main.iterdir()) == []


def test_main_with_json_writes_the_file(fake_main, capsys):
    assert bench_main.main(["fake", "--json", "out.json"]) == 0
    assert "wrote out.json" in capsys.readouterr().out
    doc = json.loads((fake_main / "out.json").read_text())
    assert doc["subcommand"] == "fake" and doc["results"] == [{"rows": 3}]
    assert doc["args"]["json"] == "out.json"


def test_main_with_json_dash_prints_json_and_writes_nothing(fake_main, capsys):
    assert bench_main.main(["fake", "--json", "-"]) == 0
    out = capsys.readouterr().out
    assert '"subcommand": "fake"' in out and "wrote" not in out
    assert list(fake_main.iterdir()) == []


def test_decode_standalone_entry_point_takes_no_json(monkeypatch, tmp_path, capsys):
    """``python -m jax_tpusync.bench.decode`` writes nothing without ``--json`` either."""
    from jax_tpusync.bench import decode

    monkeypatch.setattr(decode, "run", lambda args: [{"rows": 1}])
    monkeypatch.setattr(decode, "COLUMNS", COLUMNS)
    monkeypatch.chdir(tmp_path)
    assert decode.main([]) == 0
    assert "wrote" not in capsys.readouterr().out
    assert list(tmp_path.iterdir()) == []


def test_serve_help_describes_its_default_case(capsys):
    """``bench --help`` describes ``serve`` by what it runs by default (the shared-prompt
    case), then the mixed step it runs with ``--case step``."""
    with pytest.raises(SystemExit):
        bench_main.build_parser().parse_args(["--help"])
    help_text = " ".join(capsys.readouterr().out.split())
    assert "requests sharing a prompt served by the loop (default)" in help_text
    assert bench_main.build_parser().parse_args(["serve"]).case == ["shared-prompt"]
