# SPDX-License-Identifier: Apache-2.0
"""pytest plugin of the hybrid-stack GPU bundle: print a failure when it happens.

pytest prints tracebacks in its closing summary, which a step stopped by a
time limit never reaches: the log then says FAILED and not why. run.py loads
this plugin (``-p hybrid_stack_failnow``) into every pytest it starts; each
failing phase of a test (setup, call, teardown) is written out at once by the
process that owns the output (the controller, under pytest-xdist).
"""

from __future__ import annotations

from typing import Any


class _FailNow:
    def pytest_runtest_logreport(self, report: Any) -> None:
        if report.failed:
            print(
                f"\n[failed now] {report.nodeid} ({report.when})\n{report.longreprtext}\n",
                flush=True,
            )


def pytest_configure(config: Any) -> None:
    if not hasattr(config, "workerinput"):  # an xdist worker's output is not shown
        config.pluginmanager.register(_FailNow(), "hybrid_stack_failnow_printer")
