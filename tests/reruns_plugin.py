"""Reruns are seen, never hidden: every test that pytest-rerunfailures ran again is listed at the end of the
run, and a rerun of a test not marked `@pytest.mark.flaky` fails the session.

A retry hides a race. The few tests allowed one are marked flaky, each with the race it tolerates named
beside the marker; any other test that needed a second run (someone passed `--reruns`) is a race nobody has
named yet, so the run fails even when its second attempt passed. Loaded by tests/conftest.py
(`pytest_plugins`), or with `-p reruns_plugin` when tests/ is on the path.
"""

from __future__ import annotations

import pytest


class RerunAudit:
    """Per session: the flaky-marked tests, and per rerun test how often it ran again and how it ended."""

    def __init__(self, config: pytest.Config) -> None:
        self.config = config
        self.marked: dict[str, int] = {}  # nodeid -> the flaky marker's reruns
        self.reruns: dict[str, int] = {}  # nodeid -> how often it was run again
        self.outcome: dict[str, str] = {}  # nodeid -> the outcome of its latest attempt

    def unmarked(self) -> list[str]:
        return [nodeid for nodeid in self.reruns if nodeid not in self.marked]

    def pytest_collection_modifyitems(self, items: list[pytest.Item]) -> None:
        for item in items:
            marker = item.get_closest_marker("flaky")
            if marker is not None:
                self.marked[item.nodeid] = int(marker.kwargs.get("reruns", marker.args[0] if marker.args else 1))

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        if report.outcome == "rerun":
            self.reruns[report.nodeid] = self.reruns.get(report.nodeid, 0) + 1
            self.outcome[report.nodeid] = "rerun"
        elif report.when == "setup" or report.failed:
            # An attempt starts with its setup; any failed phase decides the attempt.
            self.outcome[report.nodeid] = report.outcome
        elif report.when == "call" and self.outcome.get(report.nodeid) == "passed":
            self.outcome[report.nodeid] = report.outcome

    def pytest_terminal_summary(self, terminalreporter: pytest.TerminalReporter) -> None:
        if self.config.option.collectonly:
            return
        tr = terminalreporter
        tr.write_sep("=", "reruns")
        if not self.reruns:
            tr.write_line("no test was rerun")
            return
        for nodeid, count in self.reruns.items():
            then = self.outcome.get(nodeid, "?")
            if nodeid in self.marked:
                tr.write_line(f"RERUN x{count} {nodeid}: marked flaky (reruns={self.marked[nodeid]}), then {then}",
                              yellow=True)
            else:
                tr.write_line(f"RERUN x{count} {nodeid}: NOT marked flaky, then {then}", red=True, bold=True)
        unmarked = self.unmarked()
        if unmarked:
            tr.write_line(f"{len(unmarked)} test(s) not marked flaky were rerun, so the run fails: fix the race, or "
                          "mark the test @pytest.mark.flaky(reruns=N) and name the race it tolerates beside the marker",
                          red=True, bold=True)

    @pytest.hookimpl(trylast=True)
    def pytest_sessionfinish(self, session: pytest.Session) -> None:
        if self.unmarked() and session.exitstatus == pytest.ExitCode.OK:
            session.exitstatus = pytest.ExitCode.TESTS_FAILED


def pytest_configure(config: pytest.Config) -> None:
    config.pluginmanager.register(RerunAudit(config), "lorafleet-rerun-audit")
