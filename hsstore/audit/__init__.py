"""Auditing hidden-state data before training on it (`hsstore inspect`).

Silent data faults (a layer captured twice, tokens shifted against states, pre-norm declared
post-norm, padding rows, NaN) cost a whole training run. The audit reads a uniform sample of
tokens (or everything), measures per-layer statistics and runs one check per fault, each with
an OK / WARN / FAIL verdict and a one-line reason. See docs/INSPECT.md.
"""

from hsstore.audit.inputs import AuditSource, open_audit_source
from hsstore.audit.run import SCHEMA_ID, AuditOptions, AuditResult, audit, run_audit
from hsstore.audit.verdict import CheckResult, Verdict

__all__ = [
    "SCHEMA_ID",
    "AuditOptions",
    "AuditResult",
    "AuditSource",
    "CheckResult",
    "Verdict",
    "audit",
    "open_audit_source",
    "run_audit",
]
