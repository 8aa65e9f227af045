"""Reading prompt sets into one normal form, whatever their on-disk shape.

Supported inputs (the format is decided by the path, never guessed per row):

* ``*.jsonl`` / ``*.json`` (JSON Lines): each row is an object with ``messages``
  (``role``/``content``, the OpenAI chat shape), ``conversations`` (ShareGPT ``from``/``value``)
  or ``text`` (plain text).
* ``*.txt``: plain text, one prompt per non-empty line.
* a directory written by HF ``datasets`` ``save_to_disk`` (Arrow stream files listed in
  ``state.json``), or a directory of ``*.parquet`` / ``*.jsonl`` files; rows as for JSONL.
  Read with pyarrow alone, so ``datasets`` is not a dependency.

Rows that cannot be used (bad JSON, no recognised field, unknown role, nothing but whitespace)
are not fatal: they are yielded as :class:`SkippedRow` so the caller counts them and records
why. A file that cannot be opened, or has no usable row at all, is an error naming the file.

Every usable row gets a stable id: its row index plus a hash of its normalised content, so a
re-run over the same file finds exactly the samples it already committed.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hsstore.errors import BadInputError, no_such_path

# ShareGPT speaker names -> chat roles. Anything else makes the row unusable (counted), because
# guessing a role would silently change which tokens get loss.
_SHAREGPT_ROLES = {
    "human": "user",
    "user": "user",
    "gpt": "assistant",
    "assistant": "assistant",
    "chatgpt": "assistant",
    "bard": "assistant",
    "bing": "assistant",
    "model": "assistant",
    "system": "system",
    "tool": "tool",
    "function": "tool",
    "observation": "tool",
}
_CHAT_ROLES = {"system", "user", "assistant", "tool", "developer"}


@dataclass(frozen=True)
class Prompt:
    """One usable input row: either a chat (``messages``) or plain ``text``, never both."""

    index: int
    messages: tuple[tuple[str, str], ...] | None
    text: str | None
    source: str

    @property
    def sample_id(self) -> str:
        """Row index plus content hash: stable across runs, unique within one input file."""
        return f"r{self.index:08d}-{self.content_hash()[:12]}"

    def content_hash(self) -> str:
        payload: Any = (
            {"messages": [list(m) for m in self.messages]}
            if self.messages is not None
            else {"text": self.text}
        )
        blob = json.dumps(payload, ensure_ascii=False, sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(blob.encode("utf-8")).hexdigest()

    def message_dicts(self) -> list[dict[str, str]]:
        assert self.messages is not None
        return [{"role": r, "content": c} for r, c in self.messages]


@dataclass(frozen=True)
class SkippedRow:
    """A row that was read but cannot become a sample, and why."""

    index: int
    reason: str
    source: str


def read_prompts(path: str | Path) -> Iterator[Prompt | SkippedRow]:
    """Yield every row of a prompt set, in file order, as a Prompt or a SkippedRow."""
    p = Path(path)
    if not p.exists():
        raise no_such_path(p)
    if p.is_dir():
        yield from _read_dir(p)
    elif p.suffix == ".txt":
        yield from _read_txt(p)
    elif p.suffix in (".jsonl", ".json"):
        yield from _read_jsonl(p, start=0)
    else:
        raise BadInputError(
            f"unknown prompt format {p.suffix!r}: expected .jsonl, .json, .txt or a "
            "datasets directory",
            path=str(p),
        )


def normalise_row(obj: Any, index: int, source: str) -> Prompt | SkippedRow:
    """Turn one decoded row (a dict) into a Prompt, or say why it cannot be one."""
    if not isinstance(obj, dict):
        return SkippedRow(index, f"row is {type(obj).__name__}, not an object", source)
    if "messages" in obj and obj["messages"] is not None:
        return _chat(obj["messages"], "role", "content", index, source, roles=None)
    if "conversations" in obj and obj["conversations"] is not None:
        return _chat(obj["conversations"], "from", "value", index, source, roles=_SHAREGPT_ROLES)
    if "text" in obj and obj["text"] is not None:
        text = obj["text"]
        if not isinstance(text, str):
            return SkippedRow(index, "'text' is not a string", source)
        if not text.strip():
            return SkippedRow(index, "empty text", source)
        return Prompt(index, None, text, source)
    return SkippedRow(index, "no 'messages', 'conversations' or 'text' field", source)


def _chat(
    turns: Any,
    role_key: str,
    content_key: str,
    index: int,
    source: str,
    roles: dict[str, str] | None,
) -> Prompt | SkippedRow:
    if not isinstance(turns, list) or not turns:
        return SkippedRow(index, "empty conversation", source)
    out: list[tuple[str, str]] = []
    for turn in turns:
        if not isinstance(turn, dict):
            return SkippedRow(index, "conversation turn is not an object", source)
        role, content = turn.get(role_key), turn.get(content_key)
        if not isinstance(role, str) or not isinstance(content, str):
            return SkippedRow(
                index, f"turn without string {role_key!r} and {content_key!r}", source
            )
        if roles is not None:
            mapped = roles.get(role.lower())
            if mapped is None:
                return SkippedRow(index, f"unknown speaker {role!r}", source)
            role = mapped
        elif role not in _CHAT_ROLES:
            return SkippedRow(index, f"unknown role {role!r}", source)
        out.append((role, content))
    if not any(c.strip() for _, c in out):
        return SkippedRow(index, "all turns empty", source)
    return Prompt(index, tuple(out), None, source)


def _read_jsonl(p: Path, *, start: int) -> Iterator[Prompt | SkippedRow]:
    name = p.name
    with p.open("r", encoding="utf-8", errors="strict") as f:
        try:
            for lineno, line in enumerate(f):
                index = start + lineno
                if not line.strip():
                    yield SkippedRow(index, "blank line", name)
                    continue
                try:
                    obj = json.loads(line)
                except json.JSONDecodeError as exc:
                    yield SkippedRow(index, f"invalid JSON on line {lineno + 1}: {exc.msg}", name)
                    continue
                yield normalise_row(obj, index, name)
        except UnicodeDecodeError as exc:
            raise BadInputError(f"not UTF-8 text ({exc.reason})", path=str(p)) from exc


def _read_txt(p: Path) -> Iterator[Prompt | SkippedRow]:
    try:
        lines = p.read_text(encoding="utf-8").splitlines()
    except UnicodeDecodeError as exc:
        raise BadInputError(f"not UTF-8 text ({exc.reason})", path=str(p)) from exc
    for index, line in enumerate(lines):
        if line.strip():
            yield Prompt(index, None, line, p.name)
        else:
            yield SkippedRow(index, "blank line", p.name)


def _read_dir(p: Path) -> Iterator[Prompt | SkippedRow]:
    """A datasets ``save_to_disk`` directory, or a directory of parquet / jsonl files.

    Row indices run on across files (in the order listed), so ids stay unique in the set.
    """
    import pyarrow as pa
    import pyarrow.parquet as pq

    state = p / "state.json"
    if state.exists():
        try:
            files = [p / f["filename"] for f in json.loads(state.read_text())["_data_files"]]
        except (KeyError, TypeError, json.JSONDecodeError) as exc:
            raise BadInputError(f"unreadable datasets state.json: {exc}", path=str(state)) from exc
    else:
        files = sorted(p.glob("*.parquet")) + sorted(p.glob("*.jsonl"))
    if not files:
        raise BadInputError(
            "directory holds no datasets state.json, *.parquet or *.jsonl files", path=str(p)
        )
    index = 0
    for f in files:
        if f.suffix == ".jsonl":
            n = 0
            for row in _read_jsonl(f, start=index):
                n += 1
                yield row
            index += n
            continue
        try:
            if f.suffix == ".parquet":
                batches = pq.ParquetFile(f).iter_batches()
            else:  # datasets' Arrow files are IPC streams
                batches = iter(pa.ipc.open_stream(pa.memory_map(str(f))))
            for batch in batches:
                for obj in batch.to_pylist():
                    yield normalise_row(obj, index, f.name)
                    index += 1
        except pa.ArrowInvalid as exc:
            raise BadInputError(f"not a readable Arrow/Parquet file: {exc}", path=str(f)) from exc
