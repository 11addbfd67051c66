"""scripts/rotation_int4_claims.py: its rules on hand-made rows and bench runs, and the committed results."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
spec = importlib.util.spec_from_file_location("rotation_int4_claims", ROOT / "scripts" / "rotation_int4_claims.py")
claims = importlib.util.module_from_spec(spec)
spec.loader.exec_module(claims)


def _row(kld: float, top1: float, windows: list[float] | None = None, bits: float = 4.25) -> dict:
    return {"kld_mean": kld, "top1_agreement": top1, "bits_per_element": bits, "window_kld_mean": windows or [kld] * 4}


def test_quality_rules():
    rows = {
        "int8": _row(0.001, 0.98, [0.001, 0.0011, 0.0009, 0.001]),
        "rot+int8": _row(0.0008, 0.985),
        "int4": _row(0.02, 0.95),
        "rot+int4": _row(0.005, 0.97, [0.005, 0.006, 0.004, 0.005]),
        "int2": _row(2.0, 0.2, [2.0, 2.1, 1.9, 2.0]),
        "rot+int2": _row(0.1, 0.8, [0.1, 0.11, 0.09, 0.1]),
        "kivi2": _row(0.5, 0.6, [0.5, 0.52, 0.48, 0.5]),
    }
    out = {c.split(".")[0]: v for c, _, v in claims.quality_claims(rows)}
    assert out["1"] == "holds"  # 0.005 <= 0.01 and top-1 1 point behind
    assert out["2a"].startswith("holds")  # ratios 1.25 < 4 < 20 as the bits fall
    assert out["2b"].startswith("does not hold")  # rot+int2 beats kivi2 on every window
    rows["rot+int4"] = _row(0.05, 0.90)
    rows["rot+int2"] = _row(3.0, 0.1, [3.0, 3.1, 2.9, 3.0])
    out = {c.split(".")[0]: v for c, _, v in claims.quality_claims(rows)}
    assert out["1"].startswith("does not hold") and "8.0 points behind" in out["1"]
    assert out["2a"].startswith("does not hold as stated")  # rotation hurts at 2 bits
    assert out["2b"].startswith("holds")


def test_speed_rule_finds_the_crossover():
    def bench(ms8: list[float], ms4: list[float]) -> dict:
        lens = [256, 1024, 4096]
        rows = [{"kv_len": n, "method": "int8", "ms": a} for n, a in zip(lens, ms8, strict=True)]
        rows += [{"kv_len": n, "method": "int4", "ms": b} for n, b in zip(lens, ms4, strict=True)]
        machine = {"cpu": "test CPU", "cpu_capability": "AVX2", "torch_threads": 1}
        return {"meta": {"machine": machine}, "attention": rows}

    _, _, verdict = claims.speed_claim(bench([1.0, 2.0, 4.0], [1.2, 1.5, 2.0]))
    assert verdict.startswith("holds") and "from 1024 tokens" in verdict
    _, _, verdict = claims.speed_claim(bench([1.0, 2.0, 4.0], [1.2, 2.5, 5.0]))
    assert verdict.startswith("does not hold") and "never faster" in verdict
    assert claims.speed_claim({"meta": {}, "attention": []}) is None


def test_committed_claims_page_is_current(monkeypatch):
    # docs/results/rotation-int4/claims.md is what the script writes from the committed results
    monkeypatch.chdir(ROOT)
    root = Path("docs/results/rotation-int4")
    want = "\n".join(claims.main(root)).rstrip()
    assert (root / "claims.md").read_text().rstrip() == want
    assert json.loads((root / "bench-avx2" / "bench.json").read_text())["attention"]
