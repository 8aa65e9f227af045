"""Turn an AuditResult into the human report and the documented JSON (docs/INSPECT.md).

Both carry the same content; the JSON replaces NaN/inf by null so every parser accepts it.
"""

from __future__ import annotations

import math
from typing import Any

from hsstore.audit.alignment import shift_label
from hsstore.audit.run import SCHEMA_ID, AuditResult
from hsstore.audit.verdict import Verdict


def _clean(obj: Any) -> Any:
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {str(k): _clean(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_clean(v) for v in obj]
    return obj


def to_json(result: AuditResult) -> dict[str, Any]:
    """The `inspect --json` document (validated by schemas/inspect.schema.json)."""
    counts = {v.value: sum(c.verdict is v for c in result.checks) for v in Verdict}
    return _clean(
        {
            "schema": SCHEMA_ID,
            "verdict": result.verdict.value,
            "counts": counts,
            "summary": result.summary,
            "sampling": result.sampling,
            "layers": result.layers,
            "layer_pairs": result.pairs,
            "checks": [c.to_json() for c in result.checks],
            "lm_head": result.lm_head,
            "elapsed_s": result.elapsed_s,
        }
    )


def _bytes(n: int | None) -> str:
    if n is None:
        return "?"
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


def _g(x: Any) -> str:
    if x is None or (isinstance(x, float) and not math.isfinite(x)):
        return "-"
    return f"{x:.4g}" if isinstance(x, float) else str(x)


def _pct(x: float | None) -> str:
    return "-" if x is None or not math.isfinite(x) else f"{x:.1%}"


def _summary_lines(s: dict[str, Any], sampling: dict[str, Any]) -> list[str]:
    m = s["model"] or {}
    fmt = s["format"] + (f" format v{s['format_version']}" if s["format_version"] else "")
    if s.get("version") is not None:
        fmt += f", dataset version {s['version']}"
    lens = s["lengths"]
    scope = "" if lens["scope"] == "all" else " (of the samples read)"
    codec = (s["codec"] or {}).get("name", "-")
    ratio = f"{s['compression_ratio']:.2f}x" if s["compression_ratio"] else "-"
    tokens = f"{s['tokens']:,}" + ("" if s["tokens_exact"] else " (estimated)")
    lines = [
        f"  format      {fmt}",
        f"  model       {m.get('name') or '?'} (layers {_g(m.get('num_hidden_layers'))}, "
        f"hidden {s['hidden_size']}, vocab {_g(m.get('vocab_size'))}), dtype {s['dtype']}",
        f"  samples     {s['samples']:,}, tokens {tokens}",
        f"  lengths     min {_g(lens['min'])} / median {_g(lens['median'])} / p99 "
        f"{_g(lens['p99'])} / max {_g(lens['max'])}{scope}",
        f"  loss tokens {_pct(s['loss_token_fraction'])} of tokens"
        + ("" if s["loss_token_scope"] == "all" else " (of the samples read)"),
        f"  size        {_bytes(s['bytes_on_disk'])} on disk, {_bytes(s['raw_bytes'])} raw "
        f"states, ratio {ratio}, codec {codec}",
        f"  read        {sampling['samples_read']:,} samples, {sampling['tokens_read']:,} tokens "
        f"({'everything' if sampling['mode'] == 'full' else 'uniform sample, seed ' + str(sampling['seed'])})",
        "  layers",
    ]
    run = s.get("extraction")
    if run is not None:
        state = "complete" if run["complete"] else "not complete"
        if run["pending"]:
            state += " (shards not finished: " + ", ".join(run["pending"][:8]) + ")"
        lines.insert(-1, f"  extraction  {state}")
    for layer in s["layers"]:
        src = ""
        if layer["source_convention"]:
            src = f"   [{layer['source_convention']} id {layer['source_id']}]"
        lines.append(f"    {layer['index']:>3}  {layer['label']}{src}")
    return lines


_COLS = ("mean", "std", "rms", "min", "max", "abs_p50", "abs_p99", "abs_p999", "token_rms_median")


def _layer_lines(result: AuditResult) -> list[str]:
    head = ["layer", *_COLS, "nan", "inf", "zero", "const"]
    rows = [head]
    for entry in result.layers:
        r = entry["read"]
        rows.append([str(entry["index"]), *(_g(r[c]) for c in _COLS),
                     *(str(r[c]) for c in ("nan", "inf", "zero_rows", "constant_rows"))])  # fmt: skip
    widths = [max(len(row[k]) for row in rows) for k in range(len(head))]
    out = [
        "  " + "  ".join(cell.rjust(w) for cell, w in zip(row, widths, strict=True)) for row in rows
    ]
    for entry in result.layers:
        w = entry["write_time"]
        if w:
            out.append(f"  layer {entry['index']} at write time (all rows): rms {_g(w['rms'])}, "
                       f"{w['zero_rows']} zero rows, {w['nonfinite_rows']} non-finite rows "
                       f"of {w['rows']:,}")  # fmt: skip
    return out


def _lm_lines(lm: dict[str, Any]) -> list[str]:
    out = [f"lm-head agreement ({lm['model_dir']}, {lm['tokens']} loss tokens"
           + (", tied embeddings)" if lm["tied_embeddings"] else ")")]  # fmt: skip
    for t in lm["tables"]:
        out.append(f"  layer {t['layer']} ({t['layer_label']})")
        shifts = sorted({c["shift"] for c in t["cells"]})
        out.append(
            "    reading     " + "".join(f"{'shift ' + shift_label(s):>8}  " for s in shifts)
        )
        for interp in ("post_norm", "pre_norm"):
            cells = {c["shift"]: c for c in t["cells"] if c["interpretation"] == interp}
            mark = "*" if any(c["declared"] for c in cells.values()) else " "
            vals = "".join(f"{_pct(cells[s]['agreement']):>8}  " for s in shifts)
            out.append(f"    {interp:<10}{mark}  {vals}")
    out.append("    (* the declared norm reading; the declared token alignment is shift 0)")
    return out


def to_text(result: AuditResult) -> str:
    """The human report: summary, per-layer statistics, checks, lm-head table, verdict."""
    lines = [
        f"hsstore inspect {result.summary['path']}",
        *_summary_lines(result.summary, result.sampling),
    ]
    lines += ["", "per-layer statistics (rows read)", *_layer_lines(result), "", "checks"]
    for c in result.checks:
        lines.append(f"  {c.verdict.value:<4}  {c.name:<22} {c.reason}")
    if result.lm_head:
        lines += ["", *_lm_lines(result.lm_head)]
    n_fail = sum(c.verdict is Verdict.FAIL for c in result.checks)
    n_warn = sum(c.verdict is Verdict.WARN for c in result.checks)
    lines += ["", f"verdict: {result.verdict.value} ({n_fail} FAIL, {n_warn} WARN) "
              f"in {result.elapsed_s:.1f} s"]  # fmt: skip
    return "\n".join(lines)
