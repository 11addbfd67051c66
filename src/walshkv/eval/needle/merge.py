"""Adding ``walshkv needle`` runs together: a long grid in parts (e.g. the short lengths at every depth, then one
long length), each part's ``--json`` file read back, checked against the next part's settings and merged."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from walshkv.eval.needle.cells import BASELINE, NeedleResult, trial_key

if TYPE_CHECKING:
    from walshkv.eval.needle.trials import Trial

__all__ = ["MERGE_KEYS", "check_can_add", "load_needle_result", "merge_needle_results"]

#: Meta entries two runs must share for their trials to form one result: what a trial's answer depends on
#: besides its (task, length, depth, sample), and how cells are judged.
MERGE_KEYS = (
    "seed",
    "prompt",
    "needle",
    "reference",
    "min_baseline",
    "prefill",
    "prefill_chunk",
    "fused",
    "residual",
    "decoding",
    "scoring",
    "calibration",
)
_RESULT_KEYS = ("meta", "overall", "summary", "cells", "trials")


def load_needle_result(path: str | Path) -> NeedleResult:
    """Read a ``walshkv needle --json`` file back.

    Raises:
        ValueError: the file is missing, not JSON, or not a needle result (the message names the file).
    """
    path = Path(path)
    try:
        raw = json.loads(path.read_text())
    except FileNotFoundError:
        raise ValueError(f"{path}: no such file (give the --json file of an earlier walshkv needle run)") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise ValueError(
            f"{path}: not a readable JSON file ({err}); give the --json file of a walshkv needle run"
        ) from None
    if not isinstance(raw, dict) or any(k not in raw for k in _RESULT_KEYS) or "codecs" not in raw.get("meta", {}):
        raise ValueError(
            f"{path}: not a walshkv needle result (it needs the keys {', '.join(_RESULT_KEYS)}); give the --json file "
            "of a walshkv needle run"
        )
    return NeedleResult(raw["meta"], raw["trials"], raw["cells"], raw["summary"], raw["overall"])


def _run_entry(meta: Mapping[str, Any]) -> dict[str, Any]:
    """One run of a merged result: what it covered and what measured it."""
    return {
        "command": meta.get("command"),
        "lengths": meta["lengths"],
        "depths": meta["depths"],
        "samples": meta["samples"],
        "trials": meta["trials"],
        "seconds_trials": meta.get("seconds_trials"),
        "date": meta.get("date"),
        "versions": meta.get("versions"),
        "cpu": meta.get("cpu"),
    }


def check_can_add(
    earlier: NeedleResult,
    *,
    model: str,
    text: str,
    codecs: Sequence[str],
    trials: Sequence[Trial] = (),
    settings: Mapping[str, Any] | None = None,
) -> None:
    """Refuse, before anything runs, a run whose trials cannot be added to ``earlier``'s.

    Args:
        earlier: the result the new run's trials go into.
        model: the new run's model name.
        text: the new run's haystack text name.
        codecs: the new run's cache specs (presets resolved), without the reference.
        trials: the new run's trials; none may repeat one of ``earlier``'s (task, length, depth, sample).
        settings: meta entries of :data:`MERGE_KEYS` known before the run; each must equal ``earlier``'s.

    Raises:
        ValueError: naming what differs and how to run the part that would fit.
    """
    meta = earlier.meta
    fix = "run it into a file of its own (--json elsewhere, no --add-to), or repeat the earlier run's settings"
    if meta["model"]["name"] != model or meta["text"]["name"] != text:
        raise ValueError(
            f"--add-to holds {meta['model']['name']} on {meta['text']['name']}, this run is {model} on {text}: {fix}"
        )
    before = [c for c in meta["codecs"] if c != BASELINE]
    if list(codecs) != before:
        raise ValueError(
            f"--add-to has the caches {', '.join(before) or '(reference only)'}; this run has "
            f"{', '.join(codecs) or '(reference only)'}: give the same --codec list in the same order, or {fix}"
        )
    for key, value in (settings or {}).items():
        if key in MERGE_KEYS and meta.get(key) != value:
            raise ValueError(f"--add-to was run with {key} = {meta.get(key)!r}, this run with {value!r}: {fix}")
    done = {trial_key(r) for r in earlier.trials}
    again = sorted({k for t in trials if (k := (t.task, t.length, t.depth, t.sample)) in done})
    if again:
        shown = ", ".join(f"{task} L={length} d={depth:g} sample {s}" for task, length, depth, s in again[:4])
        raise ValueError(
            f"--add-to already holds {len(again)} of this run's trials ({shown}{', ...' if len(again) > 4 else ''}): "
            "give only lengths, depths or samples it does not have"
        )


def merge_needle_results(earlier: NeedleResult, later: NeedleResult) -> NeedleResult:
    """One result from two runs with disjoint trials and the same settings: cells and summaries recomputed from
    every trial; ``meta["runs"]`` lists each run (its command, lengths, depths, commit, CPU).

    Raises:
        ValueError: the runs differ in model, text, caches or a :data:`MERGE_KEYS` setting, or share a trial.
    """
    lm = later.meta
    check_can_add(
        earlier,
        model=lm["model"]["name"],
        text=lm["text"]["name"],
        codecs=[c for c in lm["codecs"] if c != BASELINE],
        settings={k: lm.get(k) for k in MERGE_KEYS},
    )
    done = {trial_key(r) for r in earlier.trials}
    again = {trial_key(r) for r in later.trials} & done
    if again:
        task, length, depth, sample = sorted(again)[0]
        raise ValueError(
            f"the runs share {len(again)} trial(s), e.g. {task} L={length} d={depth:g} sample {sample}: "
            "give disjoint lengths, depths or samples"
        )
    for task, n in lm["new_tokens"].items():
        if earlier.meta["new_tokens"].get(task, n) != n:
            raise ValueError(
                f"task {task}: new_tokens {earlier.meta['new_tokens'][task]} before, {n} now (--new-tokens)"
            )
    order = {c: i for i, c in enumerate(earlier.meta["codecs"])}
    rows = sorted([*earlier.trials, *later.trials], key=lambda r: (*trial_key(r), order[r["codec"]]))
    codecs = {}
    for name in earlier.meta["codecs"]:
        a, b = earlier.meta["codecs"][name], lm["codecs"][name]
        codecs[name] = b if b["measured_at_length"] > a["measured_at_length"] else a
    runs = list(earlier.meta.get("runs") or [_run_entry(earlier.meta)]) + list(lm.get("runs") or [_run_entry(lm)])
    keys = {trial_key(r) for r in rows}
    meta = dict(lm)
    meta.update(
        command=None,
        tasks=list(dict.fromkeys([*earlier.meta["tasks"], *lm["tasks"]])),
        lengths=sorted({*earlier.meta["lengths"], *lm["lengths"]}),
        depths=sorted({*earlier.meta["depths"], *lm["depths"]}),
        samples=max(earlier.meta["samples"], lm["samples"]),
        trials=len(keys),
        new_tokens={**earlier.meta["new_tokens"], **lm["new_tokens"]},
        needles_per_trial={**earlier.meta["needles_per_trial"], **lm["needles_per_trial"]},
        share_prefix=bool(earlier.meta.get("share_prefix")) and bool(lm.get("share_prefix")),
        codecs=codecs,
        seconds_trials=sum(r.get("seconds_trials") or 0.0 for r in runs),
        seconds_per_trial={
            name: sum(r["prefill_seconds"] + r["decode_seconds"] for r in rows if r["codec"] == name) / len(keys)
            for name in codecs
        },
        runs=runs,
    )
    return NeedleResult.from_rows(meta, rows, meta["min_baseline"])
