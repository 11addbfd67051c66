"""conftest.py's :class:`StrictCI`: under ``CI`` every skip fails, at run time and at collection.

Each case runs pytest on a tiny test file (pytester, in process) with the plugin registered as CI registers it,
and once without it: the same file then skips, so the plugin is what turns each skip into a failure.
"""

from __future__ import annotations

import pytest

from conftest import StrictCI

MODULE_IMPORTORSKIP = """
import pytest

pytest.importorskip("walshkv_no_such_module_anywhere")


def test_never_collected():
    pass
"""

MODULE_SKIP = """
import pytest

pytest.skip("no backend here", allow_module_level=True)


def test_never_collected():
    pass
"""

RUN_TIME = """
import pytest


def test_skips():
    pytest.skip("no compiler")


@pytest.mark.skipif(True, reason="marked")
def test_marked():
    pass


@pytest.mark.xfail(reason="known", strict=True)
def test_expected_failure():
    assert False


def test_passes():
    pass
"""


def _run(pytester: pytest.Pytester, source: str, strict: bool) -> pytest.RunResult:
    pytester.makepyfile(test_case=source)
    plugins = [StrictCI()] if strict else []
    return pytester.runpytest("-p", "no:cacheprovider", plugins=plugins)


@pytest.mark.parametrize("source", [MODULE_IMPORTORSKIP, MODULE_SKIP], ids=["importorskip", "allow_module_level"])
def test_a_module_skipped_at_collection_fails_under_ci(pytester, source):
    assert _run(pytester, source, strict=False).parseoutcomes() == {"skipped": 1}
    result = _run(pytester, source, strict=True)
    assert result.ret != pytest.ExitCode.OK
    outcomes = result.parseoutcomes()
    assert outcomes.get("errors", outcomes.get("error")) == 1 and "skipped" not in outcomes
    result.stdout.fnmatch_lines(["*test_case.py skipped at collection in CI, which runs everything*"])


def test_skips_at_run_time_fail_under_ci_and_xfail_stays(pytester):
    _run(pytester, RUN_TIME, strict=False).assert_outcomes(passed=1, skipped=2, xfailed=1)
    result = _run(pytester, RUN_TIME, strict=True)
    result.assert_outcomes(passed=1, failed=1, errors=1, xfailed=1)  # a skipif mark skips in setup: an error
    result.stdout.fnmatch_lines(["*skipped in CI, which runs everything*no compiler*"])
    result.stdout.fnmatch_lines(["*skipped in CI, which runs everything*marked*"])
