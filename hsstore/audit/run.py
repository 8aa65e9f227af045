"""Run an audit: plan the reads, make one pass, run every check, assemble the result."""

from __future__ import annotations

import hashlib
import os
import time
from dataclasses import dataclass, field
from typing import Any

from tqdm import tqdm

from hsstore.audit import alignment, checks, recompute
from hsstore.audit.collect import Collected, Collector, SampleRecord
from hsstore.audit.inputs import AuditSource, open_audit_source
from hsstore.audit.lm_head import OutputHead, load_output_head
from hsstore.audit.norm_fit import rows_needed
from hsstore.audit.sampling import plan_reads
from hsstore.audit.summary import build_summary
from hsstore.audit.verdict import CheckResult, Verdict, skip, worst
from hsstore.errors import BadInputError, HsstoreError

SCHEMA_ID = "hsstore.inspect/1"


@dataclass
class AuditOptions:
    """sample_tokens: token budget of the default sampled read; full: read everything."""

    sample_tokens: int = 16384
    full: bool = False
    seed: int = 0
    lm_head: str | os.PathLike[str] | None = None
    lm_head_tokens: int = 512
    model: str | os.PathLike[str] | None = None  # recompute samples with it (recompute.py)
    model_samples: int = 2
    progress: bool | None = None  # None: a bar only on a terminal


@dataclass
class AuditResult:
    summary: dict[str, Any]
    sampling: dict[str, Any]
    layers: list[dict[str, Any]]
    checks: list[CheckResult]
    lm_head: dict[str, Any] | None
    elapsed_s: float
    pairs: list[dict[str, Any]] = field(default_factory=list)
    read_lengths: list[int] = field(default_factory=list)  # token counts of the samples read

    @property
    def verdict(self) -> Verdict:
        return worst(c.verdict for c in self.checks)

    def check(self, name: str) -> CheckResult:
        return next(c for c in self.checks if c.name == name)


def audit(path: str | os.PathLike[str], options: AuditOptions | None = None) -> AuditResult:
    """Open ``path`` (hsstore dataset or a foreign format) and audit it."""
    return run_audit(open_audit_source(path), options or AuditOptions())


def _final_layers(src: AuditSource) -> list[int]:
    n = src.model.get("num_hidden_layers")
    return [i for i, s in enumerate(src.layers) if s.final_norm or (n is not None and s.depth == n)]


def _read_pass(src: AuditSource, opts: AuditOptions, final: list[int]) -> tuple[Collected, Any]:
    lengths = src.lengths()
    plan = plan_reads(
        len(src), lengths, token_budget=opts.sample_tokens, seed=opts.seed, full=opts.full
    )
    col = Collector(
        num_layers=len(src.layers),
        hidden_size=src.hidden_size,
        final_layers=final,
        seed=opts.seed,
        lm_tokens=opts.lm_head_tokens if opts.lm_head else 0,
        fit_rows=rows_needed(src.hidden_size),
    )
    disable = None if opts.progress is None else not opts.progress
    with tqdm(total=len(plan.indices), desc="inspect", unit="sample", disable=disable) as bar:
        for i in plan.indices:
            if plan.token_budget is not None and col.tokens_read >= plan.token_budget:
                break
            expected = int(lengths[i]) if lengths is not None else None
            try:
                s = src.read(i)
            except (HsstoreError, OSError) as exc:
                col.add_error(i, src.sample_id(i), str(exc), expected)
            else:
                col.add(i, s.sample_id, s.input_ids, s.loss_mask, s.hidden, expected)
            bar.update(1)
    return col.finish(), plan


def _token_facts(src: AuditSource, got: Collected) -> tuple[list, list, str, list[SampleRecord]]:
    """(sample id, ids digest) and (sample id, min, max) over every sample when that is cheap,
    else over the samples read; plus a record of the failure if the token scan hit damage."""
    scan = src.iter_tokens()
    hashes, extremes, errors = [], [], []
    try:
        for i, ids in scan or ():
            sid = src.sample_id(i)
            digest = hashlib.blake2b(ids.astype("<i8").tobytes(), digest_size=16).hexdigest()
            hashes.append((sid, digest))
            if len(ids):
                extremes.append((sid, int(ids.min()), int(ids.max())))
    except HsstoreError as exc:  # damaged token columns: a finding, not a crash
        errors.append(SampleRecord(-1, exc.sample_id or "(token columns)", error=str(exc)))
        scan = None
    if scan is None:
        ok = [r for r in got.records if r.error is None]
        return ([(r.sample_id, r.ids_hash) for r in ok],
                [(r.sample_id, r.min_id, r.max_id) for r in ok], "samples read", errors)  # fmt: skip
    return hashes, extremes, "all samples", errors


def _load_head(src: AuditSource, model_dir: str | os.PathLike[str]) -> OutputHead:
    """Load the head before reading anything, so a wrong MODEL_DIR fails at once."""
    head = load_output_head(model_dir)
    if head.hidden_size != src.hidden_size:
        raise BadInputError(
            f"model hidden size {head.hidden_size} does not match the dataset's {src.hidden_size}",
            path=str(model_dir),
        )
    return head


def _lm_head_checks(
    src: AuditSource, got: Collected, head: OutputHead | None
) -> tuple[list[CheckResult], dict[str, Any] | None]:
    if head is None:
        why = "pass --lm-head MODEL_DIR to measure token alignment against the model's head"
        return [skip("lm_head_alignment", why), skip("final_norm_exact", why)], None
    tables = []
    if got.lm_rows is not None and got.lm_targets is not None:
        for k, idx in enumerate(got.final_layers):
            tables.append(
                alignment.agreement_table(head, got.lm_rows[:, k], got.lm_targets, src.layers[idx])
            )
    used = [idx for idx in got.final_layers] if tables else []
    results = [
        alignment.check_alignment(tables, used),
        alignment.check_norm_exact(head, got.fit_rows, src.layers),
    ]
    info = {
        "model_dir": head.model_dir,
        "tied_embeddings": head.tied,
        "vocab_size": head.vocab_size,
        "tokens": int(got.lm_rows.shape[0]) if got.lm_rows is not None else 0,
        "tables": [dict(t, layer=i) for t, i in zip(tables, used, strict=True)],
    }
    return results, info


def run_audit(src: AuditSource, opts: AuditOptions) -> AuditResult:
    t0 = time.perf_counter()
    head = _load_head(src, opts.lm_head) if opts.lm_head is not None else None
    final = _final_layers(src)
    got, plan = _read_pass(src, opts, final)
    write_stats = src.write_stats()
    read_all = plan.full or len(got.records) == len(src)
    summary = build_summary(src, got.records, read_all=read_all)
    hashes, extremes, token_scope, token_errors = _token_facts(src, got)
    states = [(r.sample_id, r.states_hash) for r in got.records if r.error is None]
    loss = src.loss_tokens()
    if loss is not None:
        loss_ids, loss_scope = [src.sample_id(i) for i in range(len(src))], "all samples"
    else:
        ok = [r for r in got.records if r.error is None]
        loss_ids, loss = [r.sample_id for r in ok], [r.loss_tokens for r in ok]
        loss_scope = "samples read"
    lm_results, lm_info = _lm_head_checks(src, got, head)
    vocab = src.model.get("vocab_size") or (lm_info or {}).get("vocab_size")
    results = [
        checks.check_readable(got.records + token_errors, src.left_out, src.rebuilt),
        checks.check_nonfinite(got.layer_summaries, write_stats),
        checks.check_padding_rows(got.layer_summaries, write_stats),
        checks.check_duplicate_layers(got.pairs, src.layers),
        checks.check_duplicate_samples(hashes, states, token_scope),
        checks.check_empty_loss_masks(loss_ids, loss, loss_scope),
        checks.check_lengths(got.records),
        checks.check_depth_order(
            got.layer_summaries, src.layers, src.model.get("num_hidden_layers")
        ),
        checks.check_final_norm(got.fit_rows, src.layers, src.hidden_size),
        checks.check_model_depth(
            src.layers, src.model.get("num_hidden_layers"), head.num_hidden_layers if head else None
        ),
        checks.check_vocab(extremes, vocab, token_scope),
    ]
    results += lm_results
    if head is not None:
        at = next(i for i, r in enumerate(results) if r.name == "final_norm")
        results[at] = checks.reconcile_final_norm(results[at], lm_results[1])
    results.append(recompute.check_against_model(src, opts.model, samples=opts.model_samples))
    layers = []
    for i, s in enumerate(got.layer_summaries):
        entry = {"index": i, "label": src.layers[i].label, "read": s}
        ws = write_stats[i] if write_stats else None
        entry["write_time"] = None if ws is None else _write_time_json(ws)
        layers.append(entry)
    sampling = {
        "mode": "full" if read_all else "sample",
        "seed": opts.seed,
        "token_budget": None if opts.full else opts.sample_tokens,
        "samples_read": len(got.records),
        "tokens_read": got.tokens_read,
    }
    read_lengths = [r.num_rows for r in got.records if r.num_rows is not None]
    elapsed = time.perf_counter() - t0
    return AuditResult(
        summary, sampling, layers, results, lm_info, elapsed, got.pairs, read_lengths
    )


def _write_time_json(ws: Any) -> dict[str, Any]:
    """The core's write-time LayerStats, as exact counts plus derived moments."""
    return {
        "rows": ws.rows,
        "zero_rows": ws.zero_rows,
        "nonfinite_rows": ws.nonfinite_rows,
        "mean": ws.mean,
        "std": ws.std,
        "rms": ws.rms,
        "min": ws.min if ws.sampled_values else None,
        "max": ws.max if ws.sampled_values else None,
        "rowmax_p50": ws.rowmax_quantile(0.5),
        "rowmax_p99": ws.rowmax_quantile(0.99),
    }
