"""Foreign-format fixtures written exactly as their producers write them, for tests and benches.

Each writer mirrors the producer's own code path (cited in docs/CONVERT.md): speculators v1
``torch.save`` dicts plus its two JSON side files, SpecForge ``.ckpt``/``.ckpt.gz`` in
``rows_*`` folders, and speculators 0.5+ Arrow rows plus ``hs_{i}.safetensors``.
"""

from __future__ import annotations

import gzip
import json
from collections.abc import Sequence
from pathlib import Path

import pyarrow as pa
import torch
from safetensors.torch import save_file

from tools.synthetic import llm_like_states


def _tokens(t: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(10_000 + seed)
    ids = torch.randint(0, 32000, (t,), generator=g, dtype=torch.int64)
    mask = (torch.rand(t, generator=g) < 0.6).to(torch.int64)
    return ids, mask


def v1_sample(t: int, num_layers: int, hidden_size: int, dtype: torch.dtype, seed: int) -> dict:
    """One sample as speculators' generator saves it (per-layer tensors made contiguous)."""
    ids, mask = _tokens(t, seed)
    hidden = llm_like_states(t, num_layers, hidden_size, dtype=dtype, seed=seed)
    return {
        "input_ids": ids,
        "hidden_states": [hidden[:, k, :].contiguous() for k in range(num_layers)],
        "loss_mask": mask,
    }


def v1_data_config(layer_ids: Sequence[int], hidden_size: int, num_samples: int) -> dict:
    """``DataGenerationConfig.to_dict()`` as speculators v0.4 writes it (fields filled in)."""
    return {
        "version": "2.0",
        "generated_at": "2025-01-01T00:00:00+00:00",
        "speculators_version": "0.4.0",
        "reproducibility": {
            "command": "data_generation_offline.py --target-model-path tiny",
            "package_versions": {
                "torch": "2.9.0",
                "vllm": "0.11.0",
                "transformers": "4.57.0",
                "speculators": "0.4.0",
            },
            "gpu": "CPU ONLY",
        },
        "model": {
            "target_model_path": "tiny/llama",
            "tensor_parallel_size": 1,
            "gpu_memory_utilization": 0.8,
            "hidden_size": hidden_size,
        },
        "data": {
            "train_data_path": "sharegpt",
            "seq_length": 4096,
            "max_samples": None,
            "num_samples": num_samples,
            "seed": 0,
            "chat_template_note": "Uses tokenizer's built-in chat template",
        },
        "hidden_states": {
            "layer_ids": list(layer_ids),
            "description": "Layers selected for EAGLE3 fusion and target logits",
        },
        "generation": {"cache_dir": "hf_cache"},
        "format": {
            "file_pattern": "data_{idx}.pt",
            "schema": {
                "input_ids": {
                    "dtype": "torch.long",
                    "shape": "[seq_len]",
                    "description": "Tokenized input sequence",
                },
                "hidden_states": {
                    "dtype": "list[torch.bfloat16]",
                    "shape": f"list of [seq_len, {hidden_size}]",
                    "num_tensors": len(layer_ids),
                    "description": f"Hidden states from {len(layer_ids)} layers",
                },
                "loss_mask": {
                    "dtype": "torch.long",
                    "shape": "[seq_len]",
                    "description": "1 for assistant tokens to train on, 0 elsewhere",
                },
            },
        },
    }


def write_v1_dir(
    root: Path,
    lengths: Sequence[int],
    *,
    layer_ids: Sequence[int] = (1, 3, 5),
    hidden_size: int = 16,
    dtype: torch.dtype = torch.bfloat16,
    with_config: bool = True,
    seed: int = 0,
) -> list[dict]:
    """A speculators v1 directory: ``data_{i}.pt`` + ``sample_lengths.json`` + ``data_config.json``."""
    root.mkdir(parents=True, exist_ok=True)
    samples, sample_lengths = [], {}
    for i, t in enumerate(lengths):
        s = v1_sample(t, len(layer_ids), hidden_size, dtype, seed + i)
        torch.save(s, root / f"data_{i}.pt")
        sample_lengths[str(i)] = len(s["input_ids"])
        samples.append(s)
    (root / "sample_lengths.json").write_text(json.dumps(sample_lengths, indent=2))
    if with_config:
        cfg = v1_data_config(layer_ids, hidden_size, len(lengths))
        (root / "data_config.json").write_text(json.dumps(cfg, indent=2))
    return samples


def write_specforge_dir(
    root: Path,
    lengths: Sequence[int],
    *,
    num_aux: int = 3,
    hidden_size: int = 16,
    dtype: torch.dtype = torch.bfloat16,
    compress: bool = False,
    file_group_size: int = 2,
    seed: int = 0,
) -> list[dict]:
    """SpecForge offline output: ``rows_{a}-{b}/data_{i}.ckpt[.gz]`` dicts."""
    out = []
    for i, t in enumerate(lengths):
        ids, mask = _tokens(t, seed + i)
        states = llm_like_states(t, num_aux + 1, hidden_size, dtype=dtype, seed=seed + i)
        rec = {
            "input_ids": ids,
            "loss_mask": mask,
            "hidden_state": states[:, num_aux, :].clone().unsqueeze(0),
            "aux_hidden_state": states[:, :num_aux, :]
            .reshape(t, num_aux * hidden_size)
            .clone()
            .unsqueeze(0),
        }
        start = i // file_group_size * file_group_size
        folder = root / f"rows_{start}-{start + file_group_size}"
        folder.mkdir(parents=True, exist_ok=True)
        if compress:
            with gzip.open(folder / f"data_{i}.ckpt.gz", "wb", compresslevel=1) as f:
                torch.save(rec, f)
        else:
            torch.save(rec, folder / f"data_{i}.ckpt")
        out.append(rec)
    return out


def write_arrow_dir(
    root: Path,
    lengths: Sequence[int],
    *,
    num_layers: int = 4,
    hidden_size: int = 16,
    dtype: torch.dtype = torch.bfloat16,
    bool_mask: bool = True,
    seed: int = 0,
) -> list[dict]:
    """speculators 0.5+: a datasets ``save_to_disk`` folder plus ``hidden_states/hs_{i}.safetensors``."""
    root.mkdir(parents=True, exist_ok=True)
    (root / "hidden_states").mkdir(exist_ok=True)
    rows = []
    for i, t in enumerate(lengths):
        ids, mask = _tokens(t, seed + i)
        hidden = llm_like_states(t, num_layers, hidden_size, dtype=dtype, seed=seed + i)
        save_file(
            {"hidden_states": hidden, "token_ids": ids},
            str(root / "hidden_states" / f"hs_{i}.safetensors"),
        )
        rows.append({"input_ids": ids, "loss_mask": mask, "hidden": hidden})
    table = pa.table(
        {
            "input_ids": pa.array([r["input_ids"].tolist() for r in rows], pa.list_(pa.int64())),
            "loss_mask": pa.array(
                [
                    r["loss_mask"].bool().tolist() if bool_mask else r["loss_mask"].tolist()
                    for r in rows
                ],
                pa.list_(pa.bool_() if bool_mask else pa.int64()),
            ),
            "seq_len": pa.array([len(r["input_ids"]) for r in rows], pa.int64()),
        }
    )
    name = "data-00000-of-00001.arrow"
    with pa.OSFile(str(root / name), "wb") as sink, pa.ipc.new_stream(sink, table.schema) as w:
        w.write_table(table)
    (root / "state.json").write_text(
        json.dumps({"_data_files": [{"filename": name}], "_split": None})
    )
    (root / "dataset_info.json").write_text(json.dumps({"features": {}}))
    return rows
