"""`inspect --plot FILE.png`: per-layer magnitude histograms and the length histogram.

matplotlib is an optional dependency (the ``plot`` extra) and slow to import, so it is
imported only here, only when a plot is asked for, with the Agg backend (no display needed).
"""

from __future__ import annotations

import os
from typing import Any

import numpy as np

from hsstore.audit.run import AuditResult
from hsstore.errors import MissingExtraError


def _magnitude_hist(read: dict[str, Any]) -> tuple[np.ndarray, np.ndarray]:
    h = read["log2_hist"]
    counts = np.asarray(h["counts"], dtype=np.float64)
    exps = h["min_exp"] + np.arange(len(counts))
    return exps, counts


def save_plot(
    result: AuditResult, lengths: np.ndarray | None, path: str | os.PathLike[str]
) -> None:
    """Draw the figure; ``lengths`` are the token counts to histogram (all samples or read ones)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise MissingExtraError(
            "--plot needs matplotlib, which is not installed: pip install 'hsstore[plot]' "
            f"(the report is complete; {path} was not written)"
        ) from None
    fig, (ax_mag, ax_len) = plt.subplots(1, 2, figsize=(12, 4.5))
    for entry in result.layers:
        exps, counts = _magnitude_hist(entry["read"])
        if counts.sum() == 0:
            continue
        nz = np.flatnonzero(counts)
        sl = slice(max(nz[0] - 1, 0), nz[-1] + 2)
        ax_mag.step(2.0 ** exps[sl], counts[sl] / counts.sum(), where="post",
                    label=f"{entry['index']}: {entry['label']}")  # fmt: skip
    ax_mag.set_xscale("log", base=2)
    ax_mag.set_xlabel("|x| (log2 bins)")
    ax_mag.set_ylabel("fraction of values")
    ax_mag.set_title("per-layer magnitude of stored states (rows read)")
    if ax_mag.lines:
        ax_mag.legend(fontsize="small")
    if lengths is not None and len(lengths):
        ax_len.hist(lengths, bins=min(50, max(5, len(np.unique(lengths)))), color="tab:gray")
    ax_len.set_xlabel("tokens per sample")
    ax_len.set_ylabel("samples")
    ax_len.set_title(f"sample lengths ({result.summary['lengths']['scope']} samples)")
    fig.suptitle(f"{result.summary['path']}: {result.verdict.value}")
    fig.tight_layout()
    try:
        fig.savefig(path, dpi=100)
    finally:
        plt.close(fig)
