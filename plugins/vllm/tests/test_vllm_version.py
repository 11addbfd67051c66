"""The plugin refuses a vLLM it was not written for (it patches vLLM internals), and its extra pins the same one."""

from __future__ import annotations

import tomllib
from pathlib import Path

import pytest

from walshkv_vllm.registration import SUPPORTED_VLLM, check_vllm_version


@pytest.mark.parametrize("version", [f"{SUPPORTED_VLLM}.0", f"{SUPPORTED_VLLM}.3", f"{SUPPORTED_VLLM}.1+cpu"])
def test_the_supported_release_is_accepted(version: str) -> None:
    check_vllm_version(version)


@pytest.mark.parametrize("version", ["0.33.0", "0.31.2", "1.0.0", "unknown", "0.3"])
def test_other_releases_are_refused_naming_both_and_the_install(version: str) -> None:
    with pytest.raises(RuntimeError) as info:
        check_vllm_version(version)
    message = str(info.value)
    assert f"vLLM {version} is installed" in message and f"vllm=={SUPPORTED_VLLM}.*" in message


def test_the_extra_pins_the_supported_release() -> None:
    project = tomllib.loads((Path(__file__).resolve().parents[1] / "pyproject.toml").read_text())["project"]
    (pin,) = project["optional-dependencies"]["vllm"]
    major, minor = SUPPORTED_VLLM.split(".")
    assert pin.replace(" ", "") == f"vllm>={SUPPORTED_VLLM},<{major}.{int(minor) + 1}"
