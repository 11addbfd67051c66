"""LMCache's own server (``lmcache server``) with walshkv's serde, started as a user starts it
(``python -m walshkv.integrations.lmcache server``, from the ``walshkv[lmcache-server]`` extra) on loopback, and
driven through LMCache's own protocol by LMCache's own client (``lmcache bench server --mode cpu``: ZMQ requests,
KV in shared memory). The store policy ``skip_l1`` drops each chunk from L1 once L2 holds it, so a retrieve after
that reads L2 back through walshkv's deserializer; LMCache's client retrieves right after its store, so a retrieve
may still find the chunk in L1 (with ``rot+int4`` LMCache's exact checksums then pass or fail by that race). The
decoded K/V themselves are checked end to end in test_lmcache.py (a real Redis, identical logits)."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from walshkv.codecs import parse_codec

HEADS, HEAD_DIM, LAYERS, TOKENS = 3, 64, 30, 256  # smollm2-135m's K/V geometry, one LMCache chunk per request


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _lmcache_cli() -> str:
    cli = Path(sys.executable).with_name("lmcache")
    assert cli.exists(), "the lmcache command is missing: pip install --no-deps lmcache==0.5.6"
    return str(cli)


def _serve_and_bench(spec: str, tmp_path: Path, requests: int = 2) -> tuple[dict, list[Path]]:
    """Start the server with ``spec`` on an fs L2 under ``tmp_path``, run LMCache's client, stop the server."""
    l2 = tmp_path / "l2"
    l2.mkdir()
    zmq_port, http_port = _free_port(), _free_port()
    env = {**os.environ, "LMCACHE_TRACK_USAGE": "false", "DO_NOT_TRACK": "1", "LMCACHE_DISABLE_BANNER": "1"}
    serde = {"type": "walshkv", "spec": spec, "head_dim": HEAD_DIM, "num_kv_heads": HEADS}
    adapter = {"type": "fs", "base_path": str(l2), "serde": serde}
    server = subprocess.Popen(
        [sys.executable, "-m", "walshkv.integrations.lmcache", "server", "--host", "127.0.0.1", "--port",
         str(zmq_port), "--http-port", str(http_port), "--l1-size-gb", "0.2", "--eviction-policy", "LRU",
         "--l2-store-policy", "skip_l1", "--l2-adapter", json.dumps(adapter)],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline:
            assert server.poll() is None, server.communicate()[0][-3000:]
            try:
                socket.create_connection(("127.0.0.1", http_port), timeout=1).close()
                break
            except OSError:
                time.sleep(0.5)
        else:
            pytest.fail("LMCache's server did not answer within 180 s")
        out = tmp_path / "bench.json"
        bench = subprocess.run(
            [_lmcache_cli(), "bench", "server", "--mode", "cpu", "--transfer-mode", "lmcache_driven", "--rpc-url",
             f"tcp://127.0.0.1:{zmq_port}", "--url", f"http://127.0.0.1:{http_port}", "--num-tokens", str(TOKENS),
             "--start", "0", "--end", str(requests), "--interval", "0.1", "--kvcache-shape-spec",
             f"(2,64,16,{HEADS},{HEAD_DIM}):float32:{LAYERS}", "--format", "json", "--output", str(out), "-q"],
            env=env, capture_output=True, text=True, timeout=300, check=False,
        )  # fmt: skip
        assert out.exists(), bench.stdout[-2000:] + bench.stderr[-2000:]
        return json.loads(out.read_text())["metrics"], sorted(l2.iterdir())
    finally:
        server.terminate()
        try:
            server.wait(timeout=30)
        except subprocess.TimeoutExpired:
            server.kill()


def test_lossless_spec_round_trips_through_lmcache_server(tmp_path):
    """With ``fp32`` every chunk LMCache's client stored comes back from L2 bit for bit (LMCache's checksums)."""
    metrics, files = _serve_and_bench("fp32", tmp_path)
    assert metrics["results"]["total_requests"] == 2 and metrics["results"]["checksum_ok"] == 2
    assert metrics["warm_retrieve"]["warm_retrieve_count"] == 2
    assert len(files) == 2


def test_compressed_chunks_in_l2_hold_the_layouts_bytes(tmp_path):
    """With ``rot+int4`` each chunk LMCache's client stored sits in L2 as the codec's bytes plus walshkv's header,
    7.5x under float32, and every retrieve is answered."""
    metrics, files = _serve_and_bench("rot+int4", tmp_path)
    assert metrics["warm_retrieve"]["warm_retrieve_count"] == 2 and metrics["results"]["total_requests"] == 2
    codes = 2 * LAYERS * TOKENS * HEADS * parse_codec("rot+int4").bytes_per_vector(HEAD_DIM)
    raw = 2 * LAYERS * TOKENS * HEADS * HEAD_DIM * 4
    sizes = {f.stat().st_size for f in files}
    assert len(files) == 2 and len(sizes) == 1
    (size,) = sizes
    assert codes < size < codes + 256 and raw / size > 7.4
