"""``walshkv bench attention`` / ``walshkv bench generation``: each part's options, its help, the other part's
options refused, options before the subcommand, and the deprecated ``--part`` (one release, with a warning).

Nothing here loads a model (``no_load``); the runs stop at the checks (``_check`` replaced) except one tiny
attention bench through ``--part attention``.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import pytest

import walshkv.cli.bench as cli_bench
from walshkv.cli import main

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the no_load fixture of the CLI's fault matrix
from test_cli_errors import no_load  # noqa: F401

pytestmark = pytest.mark.usefixtures("no_load")

ATTENTION = ("--kv-len", "--codec", "--layer", "--repeats", "--threads", "--device")
GENERATION = (
    "--ctx",
    "--gen-codec",
    "--dynamic-dtype",
    "--new-tokens",
    "--prefill",
    "--prefill-chunk",
    "--gen-runs",
    "--decoded",
    "--no-reserve",
    "--malloc-mmap-threshold",
    "--calib-text",
    "--calib-tokens",
)
SHARED = ("--model", "--kv-mean-center", "--out", "--no-plot", "--quiet")


def _parsed(monkeypatch: pytest.MonkeyPatch, argv: list[str]) -> dict[str, Any]:
    """The options ``walshkv bench`` hands its checks for ``argv`` (the run stops there, exit 2)."""
    seen: dict[str, Any] = {}

    def stop(args):
        seen.update(vars(args))
        raise ValueError("stopped before the work")

    monkeypatch.setattr(cli_bench, "_check", stop)
    assert main(argv) == 2
    return {k: v for k, v in seen.items() if k not in ("argv", "func")}


def _help(argv: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    with pytest.raises(SystemExit) as exit_:
        main([*argv, "--help"])
    assert exit_.value.code == 0
    return capsys.readouterr().out


def test_each_part_parses_its_options(monkeypatch, tmp_path) -> None:
    out = str(tmp_path / "b")
    argv = "bench attention --kv-len 64,1k --codec int4 --codec rot+int4 --layer 2 --repeats 3 --device cpu"
    argv += " --kv-mean-center c.gguf --no-plot --quiet"
    att = _parsed(monkeypatch, [*argv.split(), "--out", out])
    assert att["part"] == "attention" and att["kv_len"] == [64, 1000] and att["codec"] == ["int4", "rot+int4"]
    assert (att["layer"], att["repeats"], att["device"], att["kv_mean_center"]) == (2, 3, "cpu", "c.gguf")
    assert att["out"] == out and att["no_plot"] and att["quiet"]
    argv = "bench generation --model m --ctx 40,2k --gen-codec walshkv:3.5 --dynamic-dtype float32 --new-tokens 2"
    argv += " --prefill exact --prefill-chunk 32 --gen-runs 2 --decoded --no-reserve --malloc-mmap-threshold 0"
    gen = _parsed(
        monkeypatch, [*argv.split(), "--calib-text", "t.txt", "--calib-tokens", "64", "--kv-mean-center", "c.gguf"]
    )
    assert gen["part"] == "generation" and gen["model"] == "m" and gen["ctx"] == [40, 2000]
    assert gen["gen_codec"] == ["walshkv:3.5"] and gen["dynamic_dtype"] == ["float32"] and gen["new_tokens"] == 2
    assert gen["prefill"] == "exact" and gen["prefill_chunk"] == 32
    assert gen["gen_runs"] == 2 and gen["decoded"] and gen["no_reserve"] and gen["malloc_mmap_threshold"] == 0
    assert (gen["calib_text"], gen["calib_tokens"], gen["kv_mean_center"]) == ("t.txt", 64, "c.gguf")
    # every option is there for the checks: the other part's at its default, as `walshkv bench` alone has them
    both = _parsed(monkeypatch, ["bench"])
    assert both["part"] == "all" and set(att) == set(gen) == set(both)
    assert gen["kv_len"] == both["kv_len"] and gen["repeats"] == both["repeats"] == 7 and gen["out"] == "bench"
    assert att["ctx"] == both["ctx"] and att["gen_codec"] is None and att["calib_tokens"] == both["calib_tokens"]
    both = _parsed(monkeypatch, ["bench", "--kv-len", "64", "--ctx", "40", "--codec", "int4", "--gen-codec", "int8"])
    assert (both["kv_len"], both["ctx"], both["codec"], both["gen_codec"]) == ([64], [40], ["int4"], ["int8"])


def test_options_before_the_part_count_as_after_it(monkeypatch) -> None:
    # argparse's subparsers would put the part's defaults over them (--repeats 7, --codec [b])
    args = _parsed(monkeypatch, ["bench", "--repeats", "3", "--codec", "a", "--quiet", "attention", "--codec", "b"])
    assert (args["repeats"], args["codec"], args["quiet"]) == (3, ["a", "b"], True)
    args = _parsed(monkeypatch, ["bench", "--repeats", "3", "--out", "x", "attention", "--repeats", "4"])
    assert (args["repeats"], args["out"]) == (4, "x")  # the later one wins, as for any repeated option
    args = _parsed(monkeypatch, ["bench", "--ctx", "40", "--calib-tokens", "9", "generation", "--model", "m"])
    assert (args["ctx"], args["calib_tokens"], args["model"]) == ([40], 9, "m")


def test_each_help_lists_its_own_options(capsys) -> None:
    attention = _help(["bench", "attention"], capsys)
    generation = _help(["bench", "generation"], capsys)
    both = _help(["bench"], capsys)
    for flag in (*ATTENTION, *SHARED):
        assert f"{flag} " in attention, flag
    for flag in (*GENERATION, *SHARED):
        assert f"{flag} " in generation, flag
    for flag in GENERATION:
        assert f"{flag} " not in attention, flag
    for flag in ATTENTION:
        assert f"{flag} " not in generation, flag
    for flag in (*ATTENTION, *GENERATION, *SHARED, "--part"):
        assert f"{flag} " in both, flag
    assert "--part" not in attention and "--part" not in generation
    # each with its own examples and its own part of the description
    assert "walshkv bench attention --kv-len" in attention and "walshkv bench generation" not in attention
    assert "walshkv bench generation --ctx" in generation and "walshkv bench attention" not in generation
    assert "**Attention**" in attention and "**Generation**" not in attention
    assert "**Generation**" in generation and "**Attention**" not in generation
    assert "walshkv bench attention --kv-len" in both and "walshkv bench generation --ctx" in both
    assert "deprecated" in both


@pytest.mark.parametrize(
    ("argv", "words"),
    [
        (["bench", "attention", "--ctx", "8"], "unrecognized arguments: --ctx 8"),
        (["bench", "attention", "--gen-codec", "int4"], "unrecognized arguments: --gen-codec int4"),
        (["bench", "attention", "--calib-text", "t.txt"], "unrecognized arguments: --calib-text t.txt"),
        (["bench", "generation", "--kv-len", "64"], "unrecognized arguments: --kv-len 64"),
        (["bench", "generation", "--repeats", "3"], "unrecognized arguments: --repeats 3"),
        (["bench", "--ctx", "8", "attention"], "--ctx is an option of `walshkv bench generation`, not of"),
        (["bench", "--calib-tokens", "8", "attention"], "--calib-tokens is an option of `walshkv bench generation`"),
        (["bench", "--device", "cpu", "generation"], "--device is an option of `walshkv bench attention`"),
        (["bench", "attention", "--part", "attention"], "unrecognized arguments: --part attention"),
        (["bench", "--part", "generation", "attention"], "--part generation and the subcommand attention: drop"),
    ],
)
def test_an_option_of_the_other_part_is_refused(argv, words, capsys) -> None:
    with pytest.raises(SystemExit) as exit_:
        main(argv)
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert words in err and "usage: walshkv bench " in err, err


@pytest.mark.parametrize(
    ("old", "new"),
    [
        (
            ["--part", "attention", "--kv-len", "64", "--codec", "int4"],
            ["attention", "--kv-len", "64", "--codec", "int4"],
        ),
        (
            ["--part=generation", "--ctx", "40", "--gen-codec", "int4"],
            ["generation", "--ctx", "40", "--gen-codec", "int4"],
        ),
        (["--part", "all", "--kv-len", "64", "--ctx", "40"], ["--kv-len", "64", "--ctx", "40"]),
    ],
    ids=["attention", "generation", "all"],
)
def test_part_is_deprecated_and_means_the_subcommand(old, new, monkeypatch, capsys) -> None:
    expected = _parsed(monkeypatch, ["bench", *new])
    assert "deprecated" not in capsys.readouterr().err
    assert _parsed(monkeypatch, ["bench", *old]) == expected
    warning, error = capsys.readouterr().err.splitlines()  # one line of warning, then the stopped run's error
    instead = "walshkv bench" + ("" if expected["part"] == "all" else f" {expected['part']}")
    assert warning.startswith("walshkv bench: warning: --part is deprecated") and f"write `{instead} ...`" in warning
    assert error.startswith("walshkv bench: error: ")


def test_part_attention_still_runs(tmp_path, capsys) -> None:
    out = tmp_path / "b"
    argv = ["bench", "--part", "attention", "--kv-len", "64", "--codec", "int4", "--repeats", "1"]
    assert main([*argv, "--out", str(out), "--quiet", "--no-plot"]) == 0
    (line,) = capsys.readouterr().err.splitlines()
    assert "--part is deprecated" in line and "`walshkv bench attention ...`" in line
    data = json.loads((out / "bench.json").read_text())
    assert "generation" not in data and [r["method"] for r in data["attention"]][-1] == "int4"
    assert data["meta"]["command"].startswith("walshkv bench --part attention --kv-len 64")  # as typed
