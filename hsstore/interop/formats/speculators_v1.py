"""speculators v1 offline data (speculators v0.3/v0.4 generation, read by its trainer up to v0.7).

Layout, as written by speculators' ``scripts/data_generation_offline.py``:

- ``data_{i}.pt``: ``torch.save`` of ``{"input_ids": int64 [T], "loss_mask": int64 [T],
  "hidden_states": [tensor [T, H], ...]}``, one tensor per captured layer in ascending layer order;
  the last one is the verifier's final-layer state before the final norm.
- ``sample_lengths.json``: ``{"i": T, ...}`` keyed by the file index as a string.
- ``data_config.json``: ``DataGenerationConfig.to_dict()``; we use ``hidden_states.layer_ids``,
  ``model.hidden_size`` and ``model.target_model_path``.

Layer ids follow the speculators convention: id v is the output of decoder layer v (0-based),
i.e. canonical depth v + 1, never normed.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import torch

from hsstore.dataset.dataset import Dataset
from hsstore.errors import BadInputError
from hsstore.interop.formats.base import (  # noqa: F401 (atomic_write, write_json: this module's API)
    MINE,
    NESTED,
    NOT_MINE,
    FileListReader,
    ForeignFormat,
    ForeignReader,
    ForeignSample,
    ForeignWriter,
    atomic_write,
    check_finite,
    check_layer_tensor,
    check_tokens,
    dtype_name,
    file_index,
    has_file,
    require_dir,
    require_keys,
    stack_layers,
    unique_stems,
    write_json,
)
from hsstore.interop.formats.export_refusals import export_refusal, require_prenorm_final
from hsstore.interop.formats.safe_load import open_regular
from hsstore.spec.conventions import (
    SPECULATORS,
    VLLM,
    ConventionError,
    from_canonical,
)
from hsstore.spec.layers import LayerSpec

FORMAT = "speculators-v1"
SHOWN_AS = "speculators v1"  # how messages name the format
CONFIG_FILE = "data_config.json"
LENGTHS_FILE = "sample_lengths.json"
KEYS = ("input_ids", "loss_mask", "hidden_states")
CONFIG_VERSION = "2.0"  # DataGenerationConfig.VERSION in speculators v0.3/v0.4


def list_data_files(root: Path) -> list[Path]:
    """``data_{i}.pt`` files under root (speculators' trainer walks subfolders too), by index."""
    files = [p for p in root.rglob("data_*.pt") if file_index(p.stem, "data_") is not None]
    return sorted(
        files, key=lambda p: (file_index(p.stem, "data_"), p.relative_to(root).as_posix())
    )


# data_config.json and sample_lengths.json are a few KiB (one entry per sample for the lengths).
JSON_LIMIT_BYTES = 256 << 20


def read_json(path: Path) -> Any:
    """A small JSON side file: a regular file of bounded size and nesting, or BadInputError."""
    with open_regular(path) as f:
        raw = f.read(JSON_LIMIT_BYTES + 1)
    if len(raw) > JSON_LIMIT_BYTES:
        raise BadInputError(
            f"larger than {JSON_LIMIT_BYTES >> 20} MiB, too large for a side file", path=str(path)
        )
    try:
        return json.loads(raw.decode("utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise BadInputError(f"not valid JSON ({exc})", path=str(path)) from None
    except RecursionError:
        raise BadInputError("not valid JSON (nested too deeply)", path=str(path)) from None


class SpeculatorsV1Reader(FileListReader):
    """Reads a speculators v1 directory; see the module docstring for the layout."""

    format = FORMAT
    _keys = KEYS

    def _open(self, layer_ids: Sequence[int] | None, num_hidden_layers: int | None) -> None:
        self._files = list_data_files(self.path)
        if not self._files:
            raise BadInputError("no data_{i}.pt files found", path=str(self.path))
        unique_stems(self._files, self.path, (".pt",))
        self.config = self._load_config()
        self.sample_lengths = self._load_lengths()
        ids = self._layer_ids(layer_ids)
        self.layer_ids = ids
        n = num_hidden_layers if num_hidden_layers is not None else max(ids) + 1
        self.num_hidden_layers = n
        self.num_hidden_layers_inferred = num_hidden_layers is None
        self.layers = self._canonical(SPECULATORS, ids, n)
        self.hidden_size, self.dtype = self._probe()
        model_cfg = self._config_model()
        cfg_h = model_cfg.get("hidden_size")
        if cfg_h is not None and cfg_h != self.hidden_size:
            raise BadInputError(
                f"data_config.json says hidden_size {cfg_h} but the files hold {self.hidden_size}",
                path=str(self.path / CONFIG_FILE),
            )
        name = model_cfg.get("target_model_path")
        self.model = {"name": name, "num_hidden_layers": n, "hidden_size": self.hidden_size}

    # -- metadata ------------------------------------------------------------------------------

    def _side_object(self, name: str, expected: str) -> dict | None:
        """The JSON object in side file ``name`` (None when there is none)."""
        p = self.path / name
        if not p.exists():
            return None
        obj = read_json(p)
        if not isinstance(obj, dict):
            raise BadInputError(f"expected a JSON object{expected}", path=str(p))
        return obj

    def _load_config(self) -> dict | None:
        return self._side_object(CONFIG_FILE, "")

    def _config_model(self) -> dict:
        """data_config.json's ``model`` section, its fields checked for the types we use."""
        where = str(self.path / CONFIG_FILE)
        model = (self.config or {}).get("model") or {}
        if not isinstance(model, dict):
            raise BadInputError(
                f"model is a {type(model).__name__}, expected an object", path=where
            )
        h = model.get("hidden_size")
        if h is not None and (not isinstance(h, int) or isinstance(h, bool) or h < 1):
            raise BadInputError(
                f"model.hidden_size is {h!r}, expected a positive integer", path=where
            )
        name = model.get("target_model_path")
        if name is not None and not isinstance(name, str):
            raise BadInputError(
                f"model.target_model_path is {name!r}, expected a string", path=where
            )
        return model

    def _load_lengths(self) -> dict[str, int] | None:
        obj = self._side_object(LENGTHS_FILE, ' {"i": T, ...}')
        if obj is None:
            return None
        p = self.path / LENGTHS_FILE
        for k, v in obj.items():
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                raise BadInputError(
                    f"length of sample {k!r} is {v!r}, expected a token count", path=str(p)
                )
        return {str(k): v for k, v in obj.items()}

    def _layer_ids(self, given: Sequence[int] | None) -> list[int]:
        cfg_ids = None
        if self.config is not None:
            section = self.config.get("hidden_states") or {}
            cfg_ids = section.get("layer_ids") if isinstance(section, dict) else None
            if not isinstance(cfg_ids, list) or not all(
                isinstance(v, int) and not isinstance(v, bool) for v in cfg_ids
            ):
                raise BadInputError(
                    "data_config.json has no integer list hidden_states.layer_ids",
                    path=str(self.path / CONFIG_FILE),
                )
        if given is not None and cfg_ids is not None and sorted(given) != sorted(cfg_ids):
            raise BadInputError(
                f"--layer-ids {list(given)} disagree with data_config.json layer_ids {cfg_ids}",
                path=str(self.path / CONFIG_FILE),
            )
        ids = list(given) if given is not None else cfg_ids
        if ids is None:
            raise BadInputError(
                "no data_config.json, so the layer ids are unknown; pass --layer-ids "
                "(speculators ids, e.g. 2,16,29,31)",
                path=str(self.path),
            )
        if not ids or len(set(ids)) != len(ids):
            raise BadInputError(
                f"layer ids must be distinct and non-empty, got {ids}", path=str(self.path)
            )
        # The capture hook appends states while walking the layers, so files hold them ascending.
        return sorted(ids)

    _file_kind = "data_{i}.pt file"

    @staticmethod
    def _shape_of(obj: Any) -> tuple[int, torch.dtype] | str | None:
        hs = obj.get("hidden_states") if isinstance(obj, dict) else None
        if not (isinstance(hs, (list, tuple)) and hs and isinstance(hs[0], torch.Tensor)):
            return None
        if hs[0].dim() != 2 or not hs[0].dtype.is_floating_point:
            return None
        return (
            "hidden states of width 0"
            if hs[0].shape[1] == 0
            else (int(hs[0].shape[1]), hs[0].dtype)
        )

    def read(self, i: int) -> ForeignSample:
        p = self._files[i]
        where, obj = self._load(i, self._keys)
        input_ids, loss_mask = check_tokens(obj["input_ids"], obj["loss_mask"], where)
        t = len(input_ids)
        hs = obj["hidden_states"]
        if not isinstance(hs, (list, tuple)):
            raise BadInputError(
                f"hidden_states is a {type(hs).__name__}, expected a list of [T, H] tensors",
                path=where,
            )
        if len(hs) != len(self.layers):
            raise BadInputError(
                f"hidden_states has {len(hs)} layers, expected {len(self.layers)} "
                f"(layer ids {self.layer_ids})",
                path=where,
            )
        for k, h in enumerate(hs):
            check_layer_tensor(h, k, t, self.hidden_size, self.dtype, where)
        hidden = stack_layers(list(hs), self.dtype)
        check_finite(hidden, where)
        idx = str(file_index(p.stem, "data_"))
        expect = (self.sample_lengths or {}).get(idx, t)
        if expect != t:
            raise BadInputError(f"has {t} tokens but sample_lengths.json says {expect}", path=where)
        return ForeignSample(
            p.stem, p.relative_to(self.path).as_posix(), input_ids, loss_mask, hidden
        )

    def provenance(self) -> dict[str, Any]:
        out = super().provenance()
        out["source_layer_ids"] = {"convention": SPECULATORS, "ids": self.layer_ids}
        if self.num_hidden_layers_inferred:
            out["num_hidden_layers_inferred"] = "last v1 layer id + 1 (the verifier's final layer)"
        if self.config is not None:
            out["speculators_data_config"] = self.config
        return out


# --------------------------------------------------------------------------------- writing


def _own_storage(t: torch.Tensor) -> torch.Tensor:
    """A tensor whose storage is exactly its bytes (torch.save writes whole storages)."""
    t = t.contiguous()
    if t.untyped_storage().nbytes() != t.numel() * t.element_size() or t.storage_offset() != 0:
        t = t.clone()
    return t


def write_sample(
    path: Path, input_ids: torch.Tensor, loss_mask: torch.Tensor, hidden: torch.Tensor
) -> None:
    """Write one ``data_{i}.pt`` in the v1 layout, atomically (temp file, fsync, rename)."""
    obj = {
        "input_ids": _own_storage(input_ids.to(torch.int64)),
        "hidden_states": [_own_storage(hidden[:, k, :]) for k in range(hidden.shape[1])],
        "loss_mask": _own_storage(loss_mask.to(torch.int64)),
    }
    atomic_write(path, lambda f: torch.save(obj, f))


def build_data_config(
    *,
    layer_ids: list[int],
    hidden_size: int,
    dtype: torch.dtype,
    num_samples: int,
    model_name: str | None,
    base: dict | None = None,
) -> dict:
    """A ``data_config.json`` in speculators' DataGenerationConfig layout.

    When the dataset came from v1 (``base``: the original config, kept in provenance) that
    config is written back with only the layer ids and hidden size asserted.
    """
    if base is not None:
        cfg = json.loads(json.dumps(base))
        cfg.setdefault("hidden_states", {})["layer_ids"] = list(layer_ids)
        cfg.setdefault("model", {})["hidden_size"] = hidden_size
        return cfg
    return {
        "version": CONFIG_VERSION,
        "generated_at": datetime.now(timezone.utc).isoformat(),
        "speculators_version": None,
        "reproducibility": {
            "command": "hsstore convert (export to speculators v1)",
            "package_versions": {
                "torch": torch.__version__,
                "vllm": None,
                "transformers": None,
                "speculators": None,
            },
            "gpu": None,
        },
        "model": {
            "target_model_path": model_name,
            "tensor_parallel_size": None,
            "gpu_memory_utilization": None,
            "hidden_size": hidden_size,
        },
        "data": {
            "train_data_path": None,
            "seq_length": None,
            "max_samples": None,
            "num_samples": num_samples,
            "seed": None,
            "chat_template_note": "Uses tokenizer's built-in chat template",
        },
        "hidden_states": {
            "layer_ids": list(layer_ids),
            "description": "Layers selected for EAGLE3 fusion and target logits",
        },
        "generation": {"cache_dir": None},
        "format": {
            "file_pattern": "data_{idx}.pt",
            "schema": {
                "input_ids": {
                    "dtype": "torch.long",
                    "shape": "[seq_len]",
                    "description": "Tokenized input sequence",
                },
                "hidden_states": {
                    "dtype": f"list[torch.{dtype_name(dtype)}]",
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


def v1_layer_ids(layers: Sequence[LayerSpec], num_hidden_layers: int, path: str) -> list[int]:
    """speculators ids for a dataset's layers, or BadInputError saying why v1 cannot hold them
    and which ``--layers`` would have stored a dataset it can."""
    n = num_hidden_layers
    require_prenorm_final(SHOWN_AS, layers, n, path, min_depth=1)
    try:
        ids = from_canonical(SPECULATORS, layers, n)
    except ConventionError as exc:
        raise export_refusal(SHOWN_AS, str(exc), layers, n, path, min_depth=1) from None
    if ids != sorted(set(ids)):
        raise export_refusal(
            SHOWN_AS,
            f"its files list layers in ascending order, but this dataset stores ids {ids}",
            layers,
            n,
            path,
            min_depth=1,
        )
    return ids


class SpeculatorsV1Writer(ForeignWriter):
    """Writes ``data_{k}.pt`` files, then ``sample_lengths.json`` and ``data_config.json``."""

    format = FORMAT

    def __init__(self, ds: Dataset, out: Path, *, source: str, num_hidden_layers: int) -> None:
        self.ds, self.out = ds, out
        self.num_hidden_layers = num_hidden_layers
        self.layer_ids = v1_layer_ids(ds.layers, num_hidden_layers, source)

    def sample_path(self, k: int) -> Path:
        return self.out / f"data_{k}.pt"

    def is_own(self, relative: Path) -> bool:
        name = relative.name
        if name in (LENGTHS_FILE, CONFIG_FILE):
            return True
        return name.endswith(".pt") and file_index(name[:-3], "data_") is not None

    def write(self, k: int, input_ids, loss_mask, hidden) -> None:
        write_sample(self.sample_path(k), input_ids, loss_mask, hidden)

    def finish(self) -> None:
        ds = self.ds
        lengths = [int(v) for v in ds.index.column("num_tokens").to_pylist()]
        write_json(self.out / LENGTHS_FILE, {str(k): t for k, t in enumerate(lengths)})
        manifest = ds.manifest
        base = manifest.provenance.get("speculators_data_config")
        cfg = build_data_config(
            layer_ids=self.layer_ids,
            hidden_size=ds.hidden_size,
            dtype=ds.dtype,
            num_samples=len(ds),
            model_name=manifest.model.name if manifest.model else None,
            base=base,
        )
        if base is None:
            # speculators 0.7+ takes --target-layer-ids in vLLM's convention (id = depth), one
            # more than the v1 ids above for the same states; recording both keeps a drafter
            # config written from this file from being off by one. v1 readers ignore the extra
            # key. A config that came from v1 is written back as it was (round trips are exact);
            # the export's note says the vLLM ids either way.
            cfg["hidden_states"]["vllm_layer_ids"] = from_canonical(
                VLLM, ds.layers, self.num_hidden_layers
            )
        write_json(self.out / CONFIG_FILE, cfg)

    def notes(self) -> list[str]:
        vllm = from_canonical(VLLM, self.ds.layers, self.num_hidden_layers)
        return [
            f"data_config.json layer_ids {self.layer_ids} are v1 ids; speculators 0.7+ "
            f"--target-layer-ids takes vLLM ids: {','.join(map(str, vllm))}"
        ]


def detect(folder: Path) -> int:
    """Its config or data files at the top; data files only in subfolders rank below others."""
    if (folder / CONFIG_FILE).exists() or has_file(folder, "data_*.pt"):
        return MINE
    return NESTED if has_file(folder, "**/data_*.pt") else NOT_MINE


FOREIGN_FORMAT = ForeignFormat(
    FORMAT, "data_*.pt", detect, SpeculatorsV1Reader, SpeculatorsV1Writer
)
