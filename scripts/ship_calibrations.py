#!/usr/bin/env python3
"""Write the calibrations that ship with walshkv: src/walshkv/calibrations/MODEL/NEEDS.gguf and manifest.json.

For each model of src/walshkv/model_presets.json (scripts/ship_presets.py), one run of the K/V statistics: the run
`walshkv eval` made in every run before the files shipped, on the same tokens (the first 8,192 tokens of the first
half of python-docs by characters, in 16 windows of 512 tokens: walshkv.cli.eval.default_calibration and
walshkv.calibration.collect_kv_stats with the protocol defaults). The evaluation text of `walshkv eval` on
python-docs is its second half, so no token of it was calibrated on. Then one file per distinct calibration need of
the model's presets (walshkv.preset_file.calibration_needs: K before or after RoPE, the K mean's basis, dense or
diagonal eq+ transforms), written without a preset name (walshkv.preset_file.write_calibration_file): a model's
presets that read the same parts share one file. The manifest records for each file its sha256 and size, the
presets it serves and their specs, the model's identity (walshkv.identity.model_identity), the calibration text
(name, source, sha256 of its characters, tokens, windows) and the commit, command, date, library versions, CPU and
torch thread count (torch's sums and the eq+ fits' linear algebra round by both: the files repeat bit for bit on the
same CPU kind and thread count; regenerated there, every file came out byte-identical).

    python scripts/ship_calibrations.py                      # every model (qwen2.5-1.5b takes minutes on 2 cores)
    python scripts/ship_calibrations.py --model smollm2-135m # one model; the others' entries are kept
    python scripts/ship_calibrations.py --check              # files vs manifest vs model_presets.json (no model)

Each run (and ``--markdown``, without calibrating) also writes docs/results/presets/calibrations.md, the table of
shipped files that docs/presets.md shows (block ``shipped-calibrations``: sizes and deflated sizes from the files).

Run it from a clean, committed tree (the manifest records the commit; a dirty one is recorded as such) after
model_presets.json, the calibration code or the protocol defaults change, and commit the files with the manifest.
`walshkv calibrate --preset NAME --model MODEL --text python-docs` writes the same statistics for one preset (with
the preset named in the file), for a model or a text of your own.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import shlex
import sys
import zlib
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "src" / "walshkv"
OUT = PACKAGE / "calibrations"
MANIFEST = OUT / "manifest.json"
ABOUT = (
    "calibration files shipped with walshkv, written by scripts/ship_calibrations.py: per model, one file per "
    "distinct calibration need of its presets (model_presets.json), all from one run of the statistics on the first "
    "half of python-docs; walshkv.shipped checks each file's sha256 and the model's identity before using it"
)


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _load_manifest() -> dict[str, Any]:
    if MANIFEST.is_file():
        return json.loads(MANIFEST.read_text())
    return {"format": 1, "about": ABOUT, "models": {}}


def _model_presets() -> dict[str, Any]:
    return json.loads((PACKAGE / "model_presets.json").read_text())["models"]


TABLE = ROOT / "docs" / "results" / "presets" / "calibrations.md"


def _deflated(path: Path) -> int:
    """Bytes of the file deflated as a wheel stores it (zip's raw deflate at level 6)."""
    c = zlib.compressobj(6, zlib.DEFLATED, -15)
    return len(c.compress(path.read_bytes()) + c.flush())


def _k_kind(needs: dict[str, Any]) -> str:
    eq = needs.get("k_eq")
    where = "before RoPE" if needs.get("k_before_rope") else "after RoPE"
    if eq and eq.startswith("eqr:"):
        return f"block frame, `eqr:{eq.split(':')[1]}`"
    return f"{where}, `{eq}+`" if eq else where


def markdown() -> str:
    """The table of shipped calibration files (docs/presets.md, "Shipped calibrations"), from the manifest."""
    lines = [
        "| file (in `walshkv/calibrations/`) | serves | K | bytes | in the wheel (deflated) |",
        "|---|---|---|---|---|",
    ]
    for model, entry in _load_manifest().get("models", {}).items():
        for name, info in sorted(entry["files"].items()):
            path = OUT / model / name
            served = ", ".join(f"`{p}`" for p in info["presets"])
            deflated = f"{_deflated(path):,}" if path.is_file() else "missing"
            lines.append(f"| `{model}/{name}` | {served} | {_k_kind(info['needs'])} | {info['size']:,} | {deflated} |")
    return "\n".join(lines) + "\n"


def check() -> list[str]:
    """Every problem with the shipped files (empty: all in step): a preset of model_presets.json without its file or
    with a file of other needs, a file missing, changed or not in the manifest."""
    from walshkv.preset_file import calibration_needs

    problems = []
    data = _load_manifest()
    models = data.get("models", {})
    for model, entry in _model_presets().items():
        shipped = models.get(model)
        if shipped is None:
            problems.append(f"{model}: no calibration in the manifest; run python scripts/ship_calibrations.py")
            continue
        for preset, choice in entry["presets"].items():
            needs = calibration_needs(choice["spec"])
            name = shipped["presets"].get(preset, "absent")
            want = None if needs is None else f"{needs.name}.gguf"
            if name != want:
                problems.append(f"{model} {preset}: the manifest names {name}, its spec reads {want}")
            elif want is not None and shipped["files"][want]["specs"].get(preset) != choice["spec"]:
                problems.append(f"{model} {preset}: {want} was written for another spec than the shipped one")
        for name, info in shipped["files"].items():
            path = OUT / model / name
            if not path.is_file():
                problems.append(f"{path.relative_to(ROOT)}: missing")
            elif (path.stat().st_size, _sha256(path)) != (info["size"], info["sha256"]):
                problems.append(f"{path.relative_to(ROOT)}: size or sha256 differs from the manifest")
    for path in sorted(OUT.glob("*/*")):
        if path.name not in models.get(path.parent.name, {}).get("files", {}):
            problems.append(f"{path.relative_to(ROOT)}: not in the manifest (remove it or regenerate)")
    for model in models:
        if model not in _model_presets():
            problems.append(f"{model}: in the manifest but not in model_presets.json")
    if not TABLE.is_file() or TABLE.read_text() != markdown():
        problems.append(
            f"{TABLE.relative_to(ROOT)}: out of step with the manifest; run scripts/ship_calibrations.py --markdown"
        )
    return problems


def ship(model_names: list[str], command: str) -> None:
    """Calibrate each model once and write its files and its manifest entry."""
    import torch

    from walshkv.calibration import collect_kv_stats
    from walshkv.cli.eval import default_calibration
    from walshkv.data import load_text
    from walshkv.defaults import CALIB_TOKENS, CTX
    from walshkv.eval.provenance import cpu_meta
    from walshkv.eval.report import library_versions, timestamp
    from walshkv.fileio import write_text_atomic
    from walshkv.identity import model_identity
    from walshkv.models import load_model
    from walshkv.preset_file import calibration_needs, write_calibration_file

    versions = library_versions()  # the commit before any file is written
    # torch's results (the sums, the eq+ fits' linear algebra) depend on the CPU and the thread count: the files are
    # reproducible bit for bit with both
    machine = {"cpu": cpu_meta(), "torch_threads": torch.get_num_threads()}
    if versions["commit"].endswith("-dirty"):
        print(f"warning: the tree is dirty ({versions['commit']}); the manifest records it so", file=sys.stderr)
    data = _load_manifest()
    table = _model_presets()
    calib, evaluated = default_calibration(load_text("python-docs"))
    for name in model_names:
        presets = table[name]["presets"]
        groups: dict[str, tuple[Any, list[str]]] = {}
        for preset, choice in presets.items():
            needs = calibration_needs(choice["spec"])
            if needs is not None:
                groups.setdefault(needs.name, (needs, []))[1].append(preset)
        lm = load_model(name, progress=False)
        print(f"{name}: calibrating on {CALIB_TOKENS:,} tokens of {calib.name} in windows of {CTX}", file=sys.stderr)
        stats = collect_kv_stats(lm, calib, tokens=CALIB_TOKENS, ctx=CTX)
        folder = OUT / name
        folder.mkdir(parents=True, exist_ok=True)
        for old in folder.glob("*.gguf"):
            if old.stem not in groups:
                old.unlink()
        identity = model_identity(lm.model.config)
        files = {}
        for stem, (needs, served) in sorted(groups.items()):
            path = folder / f"{stem}.gguf"
            write_calibration_file(path, lm, needs, stats)
            files[path.name] = {
                "sha256": _sha256(path),
                "size": path.stat().st_size,
                "presets": served,
                "specs": {p: presets[p]["spec"] for p in served},
                "needs": {
                    "k_before_rope": needs.pre_rope,
                    "k_mean_basis": needs.basis,
                    "k_eq": needs.k_eq,
                    "v_eq": needs.v_eq,
                },
                "model_identity": identity,
                "calibration": {
                    "text": calib.name,
                    "source": calib.source,
                    "chars": len(calib.content),
                    "text_sha256": hashlib.sha256(calib.content.encode()).hexdigest(),
                    "tokens": stats.tokens,
                    "ctx": CTX,
                    "windows": stats.tokens // CTX,
                    "which_tokens": f"the first {stats.tokens:,} tokens of {calib.name} (the first half of "
                    f"python-docs by characters); `walshkv eval` on python-docs scores {evaluated.name}, its second "
                    "half",
                },
                "produced_by": {"command": command, "date": timestamp(), "versions": versions, **machine},
            }
            print(f"wrote {path.relative_to(ROOT)}: {', '.join(served)} ({files[path.name]['size']:,} bytes)")
        data["models"][name] = {
            "identity": identity,
            "presets": {p: next((f for f, i in files.items() if p in i["presets"]), None) for p in presets},
            "files": files,
        }
        del lm
    data["format"], data["about"] = 1, ABOUT
    data["models"] = dict(sorted(data["models"].items()))
    write_text_atomic(MANIFEST, json.dumps(data, indent=1, sort_keys=True) + "\n")
    print(f"wrote {MANIFEST.relative_to(ROOT)}")
    TABLE.write_text(markdown())
    print(
        f"wrote {TABLE.relative_to(ROOT)} (paste it: python scripts/update_readme.py {TABLE.relative_to(ROOT)} "
        "docs/presets.md shipped-calibrations)"
    )


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", action="append", help="a model of model_presets.json (repeatable; default: all)")
    ap.add_argument("--check", action="store_true", help="exit 1 if a file or the manifest is out of step")
    ap.add_argument("--markdown", action="store_true", help=f"write {TABLE.relative_to(ROOT)} from the manifest only")
    args = ap.parse_args()
    if args.markdown:
        TABLE.parent.mkdir(parents=True, exist_ok=True)
        TABLE.write_text(markdown())
        print(f"wrote {TABLE.relative_to(ROOT)}")
        return 0
    if args.check:
        problems = check()
        print(
            "\n".join(problems) or "the shipped calibrations are in step", file=sys.stderr if problems else sys.stdout
        )
        return 1 if problems else 0
    table = _model_presets()
    names = args.model or sorted(table)
    unknown = [n for n in names if n not in table]
    if unknown:
        raise SystemExit(f"not in model_presets.json: {', '.join(unknown)}; models: {', '.join(sorted(table))}")
    ship(names, "python scripts/ship_calibrations.py" + "".join(f" --model {shlex.quote(n)}" for n in args.model or []))
    problems = check()
    if problems:
        print("\n".join(problems), file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
