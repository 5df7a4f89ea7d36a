"""The run's time budget (tests/time_budget.py) fails what exceeds it, and nothing else."""

import pytest

pytest_plugins = ["pytester"]

SUITE = """
import time

def test_quick():
    pass

def test_slow_call():
    time.sleep(0.6)

def test_slow_in_pieces(pieces):
    time.sleep(0.25)
"""

CONFTEST = """
import time
import pytest

@pytest.fixture
def pieces():
    time.sleep(0.25)  # setup
    yield
    time.sleep(0.25)  # teardown
"""


def _run(pytester: pytest.Pytester, *options: str) -> pytest.RunResult:
    pytester.makeconftest(CONFTEST)
    pytester.makepyfile(test_suite=SUITE)
    return pytester.runpytest("-p", "time_budget", *options)


def test_a_test_over_its_seconds_fails_counting_setup_call_and_teardown(pytester):
    result = _run(pytester, "--max-test-seconds", "0.5")
    result.assert_outcomes(passed=3, errors=2)
    result.stdout.fnmatch_lines([
        "*test_slow_call took * s (setup + call + teardown), more than --max-test-seconds 0.5",
        "*test_slow_in_pieces took * s (setup + call + teardown), more than --max-test-seconds 0.5",
    ])
    assert "test_quick took" not in result.stdout.str()


def test_a_run_over_its_seconds_fails_with_a_line_saying_so(pytester):
    result = _run(pytester, "--max-run-seconds", "0.5")
    result.assert_outcomes(passed=3)
    assert result.ret == pytest.ExitCode.TESTS_FAILED
    result.stdout.fnmatch_lines(["the run took * s, more than --max-run-seconds 0.5"])


def test_within_both_budgets_the_run_passes(pytester):
    result = _run(pytester, "--max-test-seconds", "5", "--max-run-seconds", "60")
    result.assert_outcomes(passed=3)
    assert result.ret == pytest.ExitCode.OK
