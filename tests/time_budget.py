"""A time budget for the test run, so that the suite does not drift back to half an hour.

``--max-test-seconds S``: a test whose setup, call and teardown together take more than ``S``
seconds fails (at its teardown, naming the time and the budget), even when its assertions
passed. ``--max-run-seconds S``: the run fails (exit status 1, a line at the end) when all of
it took more than ``S`` seconds. Both are off unless given; ``make test`` gives them. Its hooks are
tests/conftest.py's (imported there); ``-p time_budget`` loads it where tests/ is importable.
"""

from __future__ import annotations

import time

import pytest

_SPENT = pytest.StashKey[float]()  # a test's seconds so far (setup, call, teardown)
_STARTED = pytest.StashKey[float]()  # when the run started


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("time budget")
    group.addoption("--max-test-seconds", type=float, default=None, metavar="S",
                    help="fail a test whose setup, call and teardown take more than S seconds together")
    group.addoption("--max-run-seconds", type=float, default=None, metavar="S",
                    help="fail the run when it takes more than S seconds")


def pytest_sessionstart(session: pytest.Session) -> None:
    session.stash[_STARTED] = time.monotonic()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo):
    outcome = yield
    report: pytest.TestReport = outcome.get_result()
    limit = item.config.getoption("max_test_seconds")
    if limit is None:
        return
    spent = item.stash.get(_SPENT, 0.0) + report.duration
    item.stash[_SPENT] = spent
    if report.when == "teardown" and spent > limit and not report.failed:
        # Reported as an error at teardown: the test's own outcome stays as it was.
        report.outcome = "failed"
        report.longrepr = (f"{item.nodeid} took {spent:.1f} s (setup + call + teardown), more than "
                           f"--max-test-seconds {limit:g}")


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    limit = session.config.getoption("max_run_seconds")
    if limit is None:
        return
    spent = time.monotonic() - session.stash[_STARTED]
    if spent > limit:
        session.config._time_budget_exceeded = (spent, limit)  # noqa: SLF001 - read by the summary
        if session.exitstatus == pytest.ExitCode.OK:
            session.exitstatus = pytest.ExitCode.TESTS_FAILED


def pytest_terminal_summary(terminalreporter, exitstatus: int, config: pytest.Config) -> None:
    exceeded = getattr(config, "_time_budget_exceeded", None)
    if exceeded is not None:
        spent, limit = exceeded
        terminalreporter.write_line(f"the run took {spent:.0f} s, more than --max-run-seconds {limit:g}", red=True)
