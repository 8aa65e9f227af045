"""Verdicts: every check answers OK / WARN / FAIL (or SKIP when it cannot apply) plus one line.

Keeping the verdict vocabulary in one place lets the text report, the JSON report and the CLI
exit code agree on what "failed" means.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from enum import Enum
from typing import Any


class Verdict(str, Enum):
    """Outcome of one check. Order of severity: SKIP < OK < WARN < FAIL."""

    SKIP = "SKIP"
    OK = "OK"
    WARN = "WARN"
    FAIL = "FAIL"

    @property
    def severity(self) -> int:
        return _SEVERITY[self]


_SEVERITY = {Verdict.SKIP: 0, Verdict.OK: 1, Verdict.WARN: 2, Verdict.FAIL: 3}


@dataclass(frozen=True)
class CheckResult:
    """One check's verdict, a one-line reason a person can act on, and machine-readable details."""

    name: str
    verdict: Verdict
    reason: str
    details: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "verdict": self.verdict.value,
            "reason": self.reason,
            "details": self.details,
        }


def worst(verdicts: Iterable[Verdict]) -> Verdict:
    """The most severe verdict; OK when nothing ran (SKIPs alone do not make a dataset bad)."""
    out = Verdict.OK
    for v in verdicts:
        if v.severity > out.severity:
            out = v
    return out


def ok(name: str, reason: str, **details: Any) -> CheckResult:
    return CheckResult(name, Verdict.OK, reason, details)


def warn(name: str, reason: str, **details: Any) -> CheckResult:
    return CheckResult(name, Verdict.WARN, reason, details)


def fail(name: str, reason: str, **details: Any) -> CheckResult:
    return CheckResult(name, Verdict.FAIL, reason, details)


def skip(name: str, reason: str, **details: Any) -> CheckResult:
    return CheckResult(name, Verdict.SKIP, reason, details)
