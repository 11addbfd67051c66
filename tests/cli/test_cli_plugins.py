"""The command line's shape: command plugins (the ``walshkv.commands`` entry points) and the shared parents."""

from __future__ import annotations

import argparse
import ast
from pathlib import Path

import pytest

import walshkv.cli
from walshkv import defaults
from walshkv.cli import PLUGIN_GROUP, build_parser, main
from walshkv.cli.common import calibration_parent, model_parent, output_parent, windows_parent

SRC = Path(__file__).resolve().parents[2] / "src" / "walshkv"


class _EntryPoint:
    """What ``importlib.metadata.entry_points`` hands out, as far as ``build_parser`` uses it."""

    def __init__(self, name: str, load) -> None:
        self.name, self.value, self.group = name, f"demo_plugin:{name}", PLUGIN_GROUP
        self._load = load

    def load(self):
        return self._load()


def _demo(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("demo", help="a plugin's command", parents=[model_parent(), output_parent()])
    p.set_defaults(func=lambda args: print(f"demo on {args.model}") or 0)


def _plugins(monkeypatch: pytest.MonkeyPatch, *eps: _EntryPoint) -> None:
    def entry_points(group: str):
        assert group == PLUGIN_GROUP
        return list(eps)

    monkeypatch.setattr(walshkv.cli, "entry_points", entry_points)


def test_a_plugin_adds_its_command(monkeypatch, capsys) -> None:
    _plugins(monkeypatch, _EntryPoint("demo", lambda: _demo))
    assert main(["demo", "--quiet"]) == 0
    assert capsys.readouterr().out == f"demo on {defaults.DEFAULT_MODEL}\n"


def _missing():
    raise ModuleNotFoundError("No module named 'demo_plugin'")


def _raises_on_register(sub: argparse._SubParsersAction) -> None:
    raise RuntimeError("half-installed")


def _takes_eval(sub: argparse._SubParsersAction) -> None:
    sub.add_parser("eval")


@pytest.mark.parametrize(
    ("load", "said"),
    [
        (_missing, "No module named 'demo_plugin'"),
        (lambda: _raises_on_register, "half-installed"),
        (lambda: _takes_eval, "eval"),
    ],
    ids=["fails-to-load", "fails-to-register", "name-taken"],
)
def test_a_broken_plugin_warns_and_the_core_keeps_working(monkeypatch, capsys, load, said) -> None:
    _plugins(monkeypatch, _EntryPoint("broken", load))
    assert main(["codecs", "--head-dim", "128"]) == 0
    captured = capsys.readouterr()
    assert "int4" in captured.out
    assert "warning: skipped the command plugin 'broken'" in captured.err and said in captured.err
    assert PLUGIN_GROUP in captured.err


def test_the_core_never_imports_research() -> None:
    for path in SRC.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else []
            if isinstance(node, ast.ImportFrom):
                names = [node.module or ""]
            assert not any(n.split(".")[0] == "walshkv_research" for n in names), f"{path} imports walshkv_research"


def test_parents_take_their_defaults_from_walshkv_defaults() -> None:
    parser = argparse.ArgumentParser(parents=[model_parent(), windows_parent(), calibration_parent(), output_parent()])
    args = parser.parse_args([])
    assert (args.model, args.text) == (defaults.DEFAULT_MODEL, defaults.DEFAULT_TEXT)
    assert (args.ctx, args.windows, args.calib_tokens) == (defaults.CTX, defaults.WINDOWS, defaults.CALIB_TOKENS)
    assert args.quiet is False and args.calib_text is None and args.kv_mean_center is None


def test_commands_share_one_definition_of_each_option() -> None:
    """--model, --text, --ctx and --quiet read the same everywhere they mean the same (eval, sweep, rd)."""
    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    for name in ("eval", "sweep", "rd", "calibrate", "recommend"):
        parser = sub.choices[name]
        for dest, default in (
            ("model", defaults.DEFAULT_MODEL),
            ("text", defaults.DEFAULT_TEXT),
            ("ctx", defaults.CTX),
        ):
            assert parser.get_default(dest) == default, (name, dest)
    assert sub.choices["recommend"].get_default("windows") == defaults.RECOMMEND_WINDOWS
    assert sub.choices["eval"].get_default("windows") == sub.choices["sweep"].get_default("windows") == defaults.WINDOWS
