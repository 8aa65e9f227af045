"""Prompt -> (input_ids, loss_mask) with the model's own tokenizer and chat template.

The loss-mask rule (also in docs/EXTRACT.md):

* Chat rows: ``loss_mask`` is 1 exactly on the tokens the template renders for an assistant
  message *after* the assistant header, up to and including whatever the template emits to close
  that turn (e.g. ``<|eot_id|>``), because the drafter must learn to predict the end of a turn
  too. System, user and tool turns, role headers and BOS are 0.
* Plain-text rows: every token is 1 (there are no roles; the whole text is a target).

Finding assistant spans robustly, without per-template regexes: the template is rendered
incrementally. For assistant message *i*, ``render(messages[:i], add_generation_prompt=True)``
ends exactly where the assistant's own text begins, and ``render(messages[:i+1])`` ends where its
turn ends. When both are prefixes of the full rendering (true for templates that render turns
independently of later ones, which is nearly all), the character span between them is the
assistant span. Templates that rewrite earlier turns (e.g. dropping the reasoning of past
assistant turns) break the prefix property; then the message content itself is searched for in
the full rendering after the previous span, and if it cannot be found the row is skipped, never
given a guessed mask. Character spans become token masks through the fast tokenizer's offset
mapping: a token is in the mask when its first character is inside a span.

Slow (Python) tokenizers, such as Kimi-K2.x's tiktoken one, have no offset mapping. For them the
rendering is cut at the span boundaries and each piece is tokenised on its own; the pieces'
tokens are used only if together they are exactly the tokens of the whole rendering (template
boundaries sit next to special tokens, so this holds for the usual templates). Otherwise the
row is skipped with that reason, never given a guessed mask.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from hsstore.errors import BadInputError
from hsstore.extractors.prompts import Prompt, SkippedRow


@dataclass(frozen=True)
class TokenizedPrompt:
    """What the extractor feeds the model and stores next to the hidden states."""

    sample_id: str
    index: int
    input_ids: torch.Tensor  # int64 [T]
    loss_mask: torch.Tensor  # int64 0/1 [T]
    source: str
    truncated: bool

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])


class ChatTokenizer:
    """Tokenises prompts for one model; ``max_length`` truncates (None = keep everything)."""

    def __init__(self, tokenizer: Any, *, max_length: int | None = None, path: str | None = None):
        if max_length is not None and max_length < 1:
            raise BadInputError(f"--max-length must be >= 1, got {max_length}")
        self.tokenizer = tokenizer
        self.max_length = max_length
        self.path = path

    @property
    def has_chat_template(self) -> bool:
        return bool(getattr(self.tokenizer, "chat_template", None))

    def encode(self, prompt: Prompt) -> TokenizedPrompt | SkippedRow:
        """Tokenise one prompt, or say why it yields no usable sample."""
        if prompt.messages is not None:
            got = self._encode_chat(prompt)
            if isinstance(got, str):
                return SkippedRow(prompt.index, got, prompt.source)
            ids, mask = got
        else:
            assert prompt.text is not None
            ids = list(self.tokenizer(prompt.text, add_special_tokens=True)["input_ids"])
            mask = [1] * len(ids)
        if not ids:
            return SkippedRow(prompt.index, "no tokens", prompt.source)
        if not any(mask):
            return SkippedRow(prompt.index, "no assistant tokens", prompt.source)
        truncated = self.max_length is not None and len(ids) > self.max_length
        if truncated:
            ids, mask = ids[: self.max_length], mask[: self.max_length]
            if not any(mask):
                why = "no assistant tokens within --max-length"
                return SkippedRow(prompt.index, why, prompt.source)
        return TokenizedPrompt(
            sample_id=prompt.sample_id,
            index=prompt.index,
            input_ids=torch.tensor(ids, dtype=torch.int64),
            loss_mask=torch.tensor(mask, dtype=torch.int64),
            source=prompt.source,
            truncated=truncated,
        )

    def _render(self, messages: list[dict[str, str]], *, generation_prompt: bool) -> str:
        return self.tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=generation_prompt
        )

    def _encode_chat(self, prompt: Prompt) -> tuple[list[int], list[int]] | str:
        if not self.has_chat_template:
            raise BadInputError(
                "the tokenizer has no chat template, so chat rows cannot be tokenised; "
                "give plain-text prompts or a model with a chat template",
                path=self.path,
            )
        messages = prompt.message_dicts()
        try:
            full = self._render(messages, generation_prompt=False)
        except Exception as exc:  # jinja raise_exception() in templates: a row problem
            return f"chat template rejected the row: {exc}"
        spans = self._assistant_spans(messages, full)
        if isinstance(spans, str):
            return spans
        if not getattr(self.tokenizer, "is_fast", False):
            return self._mask_by_pieces(full, spans)
        enc = self.tokenizer(full, add_special_tokens=False, return_offsets_mapping=True)
        ids = list(enc["input_ids"])
        mask = [
            1 if end > start and any(a <= start < b for a, b in spans) else 0
            for start, end in enc["offset_mapping"]
        ]
        return ids, mask

    def _mask_by_pieces(
        self, full: str, spans: list[tuple[int, int]]
    ) -> tuple[list[int], list[int]] | str:
        """Slow tokenizers: tokenise the text between span boundaries piece by piece."""
        cuts = sorted({0, len(full), *(c for span in spans for c in span)})
        ids: list[int] = []
        mask: list[int] = []
        for a, b in zip(cuts, cuts[1:]):
            piece = list(self.tokenizer(full[a:b], add_special_tokens=False)["input_ids"])
            inside = int(any(s <= a < e for s, e in spans))
            ids += piece
            mask += [inside] * len(piece)
        whole = list(self.tokenizer(full, add_special_tokens=False)["input_ids"])
        if ids != whole:
            return (
                "slow tokenizer: a token crosses an assistant-turn boundary, so the loss mask "
                "cannot be derived (use a fast tokenizer for this model if one exists)"
            )
        return ids, mask

    def _assistant_spans(
        self, messages: list[dict[str, str]], full: str
    ) -> list[tuple[int, int]] | str:
        spans: list[tuple[int, int]] = []
        cursor = 0
        for i, message in enumerate(messages):
            if message["role"] != "assistant":
                continue
            span = self._span_by_prefix(messages, i, full)
            if span is None or span[0] < cursor:
                span = self._span_by_search(messages, i, full, cursor)
            if span is None:
                return f"assistant turn {i} not found in the rendered chat template"
            if span[1] > span[0]:
                spans.append(span)
            cursor = span[1]
        return spans

    def _span_by_prefix(
        self, messages: list[dict[str, str]], i: int, full: str
    ) -> tuple[int, int] | None:
        """Both renderings are prefixes of the full one: the span lies between them."""
        before = self._before(messages, i)
        try:
            upto = self._render(messages[: i + 1], generation_prompt=False)
        except Exception:
            return None
        if before is not None and upto.startswith(before) and full.startswith(upto):
            return (len(before), len(upto))
        return None

    def _span_by_search(
        self, messages: list[dict[str, str]], i: int, full: str, cursor: int
    ) -> tuple[int, int] | None:
        """For templates that render a turn differently once it is history.

        The start is still where the generation prompt ends (the history before turn i is the
        same); the end is the first occurrence of the turn's closing text (what the template
        writes after the content when turn i is last, e.g. ``<|im_end|>``). If the closing text
        is empty or blank it cannot be found reliably, so the content itself is searched for.
        """
        before = self._before(messages, i)
        content = messages[i]["content"].strip()
        if before is not None and full.startswith(before) and len(before) >= cursor:
            start = len(before)
            closing = self._closing_text(messages, i)
            if closing:
                end = full.find(closing, start)
                if end >= 0:
                    return (start, end + len(closing))
        at = full.find(content, cursor) if content else -1
        return (at, at + len(content)) if at >= 0 else None

    def _before(self, messages: list[dict[str, str]], i: int) -> str | None:
        """The rendering that ends exactly where assistant turn i's own text begins."""
        try:
            if i:
                return self._render(messages[:i], generation_prompt=True)
            # a conversation opening with the assistant: whatever precedes its content
            upto = self._render(messages[:1], generation_prompt=False)
        except Exception:
            return None
        content = messages[0]["content"].strip()
        at = upto.find(content) if content else -1
        return upto[:at] if at >= 0 else None

    def _closing_text(self, messages: list[dict[str, str]], i: int) -> str | None:
        try:
            upto = self._render(messages[: i + 1], generation_prompt=False)
        except Exception:
            return None
        tail = messages[i]["content"].strip()[-16:]
        at = upto.rfind(tail) if tail else -1
        closing = upto[at + len(tail) :] if at >= 0 else ""
        return closing if closing.strip() else None
