"""The EAGLE-3 draft model, and the frozen target head that turns stored states into soft targets.

EAGLE-3 (Li et al., 2025, arXiv:2503.01840) drafts tokens from the target's own features:

    aux states of k target layers [T, k*Ht] --fc--> g [T, H]
    token embedding e [T, H] (the target's embed_tokens, frozen)
    one decoder layer whose attention reads cat(norm(e), norm(g)) [T, 2H]  -> h [T, H]
    norm -> lm_head over a reduced draft vocabulary [T, D]

During training the draft is unrolled for several steps ("training-time test", TTT): step s feeds
the draft's own output h of step s-1 back in place of g, exactly as at inference, where the draft
runs ahead of the target without fresh features. Module and parameter names follow the EAGLE-3
checkpoints SGLang and vLLM load (``fc``, ``midlayer.*``, ``norm``, ``lm_head``, ``d2t``, ``t2d``;
see docs/TRAINER.md) so a checkpoint from this trainer serves without renaming.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from hsstore.errors import BadInputError
from hsstore.model_folder import ModelFolder


@dataclass
class DrafterConfig:
    """Shape of the drafter. The draft hidden size equals the target's, as in EAGLE-3, so the
    target's token embedding can be shared."""

    hidden_size: int
    num_aux_layers: int  # k: how many target layers are fused by fc
    vocab_size: int  # the target's vocabulary (token embedding, t2d)
    draft_vocab_size: int  # the reduced output vocabulary (lm_head, d2t)
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    target_hidden_size: int | None = None  # width of each aux state; None = hidden_size
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    max_position_embeddings: int = 4096
    norm_before_residual: bool = False  # speculators' flag: residual taken after hidden_norm

    @property
    def aux_width(self) -> int:
        return self.num_aux_layers * (self.target_hidden_size or self.hidden_size)

    def to_json(self) -> dict:
        return asdict(self)


class RMSNorm(nn.Module):
    """Llama-style RMSNorm (x / rms(x) * w), computed in float32 for stability under bf16."""

    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    dtype = x.dtype
    x = x.float()
    x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return (weight.float() * x).to(dtype)


def rope_cos_sin(
    position_ids: torch.Tensor, head_dim: int, theta: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotary tables for the given positions: [B, T] -> two [B, 1, T, head_dim] tensors."""
    inv_freq = 1.0 / theta ** (
        torch.arange(0, head_dim, 2, device=position_ids.device).float() / head_dim
    )
    freqs = position_ids.float()[..., None] * inv_freq  # [B, T, hd/2]
    emb = torch.cat([freqs, freqs], dim=-1)[:, None]
    return emb.cos(), emb.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos.to(x.dtype) + torch.cat([-x2, x1], dim=-1) * sin.to(x.dtype)


def block_causal_mask(document_ids: torch.Tensor) -> torch.Tensor:
    """[T] document id per token -> [T, T] bool, True where query i may attend key j.

    Causal inside a document and nothing across documents, so samples packed into one row train
    exactly as if each were alone.
    """
    t = document_ids.shape[-1]
    same_doc = document_ids[:, None] == document_ids[None, :]
    causal = torch.ones(t, t, dtype=torch.bool, device=document_ids.device).tril()
    return same_doc & causal


class Eagle3Attention(nn.Module):
    """Attention over the 2H-wide input cat(embedding, hidden), with the TTT key cache.

    Step 0 attends the usual block-causal way over the step-0 keys. Step s >= 1 at position i
    attends the step-0 keys of its prefix plus the keys that steps 1..s wrote at the same
    position i: that is the tree path a draft at i has seen at inference time.
    """

    def __init__(self, cfg: DrafterConfig):
        super().__init__()
        self.n_heads = cfg.num_attention_heads
        self.n_kv = cfg.num_key_value_heads
        self.head_dim = cfg.head_dim
        width_in = 2 * cfg.hidden_size
        self.q_proj = nn.Linear(width_in, self.n_heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(width_in, self.n_kv * self.head_dim, bias=False)
        self.v_proj = nn.Linear(width_in, self.n_kv * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.n_heads * self.head_dim, cfg.hidden_size, bias=False)

    def forward(
        self,
        x: torch.Tensor,  # [B, T, 2H]
        cos: torch.Tensor,
        sin: torch.Tensor,
        allowed: torch.Tensor,  # [T, T] bool, block-causal
        cache: list[tuple[torch.Tensor, torch.Tensor]],  # K/V of earlier TTT steps; appended to
    ) -> torch.Tensor:
        b, t, _ = x.shape
        q = self.q_proj(x).view(b, t, self.n_heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(b, t, self.n_kv, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(b, t, self.n_kv, self.head_dim).transpose(1, 2)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        rep = self.n_heads // self.n_kv
        k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        cache.append((k, v))

        scale = 1.0 / math.sqrt(self.head_dim)
        k0, v0 = cache[0]
        scores = (q @ k0.transpose(-1, -2)) * scale  # [B, h, T, T]
        scores = scores.masked_fill(~allowed, float("-inf"))
        # One extra key per later step, at the query's own position: a dot product, not a matmul.
        diag = [(q * kd).sum(-1, keepdim=True) * scale for kd, _ in cache[1:]]
        probs = torch.cat([scores, *diag], dim=-1).float().softmax(dim=-1).to(q.dtype)
        out = probs[..., :t] @ v0
        for j, (_, vd) in enumerate(cache[1:]):
            out = out + probs[..., t + j, None] * vd
        return self.o_proj(out.transpose(1, 2).reshape(b, t, -1))


class MLP(nn.Module):
    def __init__(self, hidden: int, inner: int):
        super().__init__()
        self.gate_proj = nn.Linear(hidden, inner, bias=False)
        self.up_proj = nn.Linear(hidden, inner, bias=False)
        self.down_proj = nn.Linear(inner, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Eagle3DecoderLayer(nn.Module):
    """The one EAGLE-3 layer: embeddings and hidden states normed separately, then concatenated."""

    def __init__(self, cfg: DrafterConfig):
        super().__init__()
        self.norm_before_residual = cfg.norm_before_residual
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)  # on the embeddings
        self.hidden_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)  # on g / previous h
        self.self_attn = Eagle3Attention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg.hidden_size, cfg.intermediate_size)

    def forward(self, embeds, hidden, cos, sin, allowed, cache) -> torch.Tensor:
        normed = self.hidden_norm(hidden)
        residual = normed if self.norm_before_residual else hidden
        x = torch.cat([self.input_layernorm(embeds), normed], dim=-1)
        h = residual + self.self_attn(x, cos, sin, allowed, cache)
        return h + self.mlp(self.post_attention_layernorm(h))


class Eagle3Drafter(nn.Module):
    """fc + token embedding + one decoder layer + norm + draft-vocab LM head, unrolled for TTT."""

    def __init__(self, cfg: DrafterConfig):
        super().__init__()
        self.config = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.fc = nn.Linear(cfg.aux_width, cfg.hidden_size, bias=False)
        self.midlayer = Eagle3DecoderLayer(cfg)
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.draft_vocab_size, bias=False)
        # Vocabulary maps in the layout EAGLE-3 checkpoints use: target = draft + d2t[draft];
        # t2d[target] is True for target tokens that exist in the draft vocabulary.
        self.register_buffer("d2t", torch.zeros(cfg.draft_vocab_size, dtype=torch.long))
        self.register_buffer("t2d", torch.ones(cfg.vocab_size, dtype=torch.bool))
        self.apply(self._init_weights)

    @property
    def draft_to_target(self) -> torch.Tensor:
        """int64 [D]: the target id of each draft id."""
        return torch.arange(len(self.d2t), device=self.d2t.device) + self.d2t

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, std=0.02)

    def forward(
        self,
        input_ids: torch.Tensor,  # [B, T] token x_{t+1} at position t (already aligned)
        aux_hidden: torch.Tensor,  # [B, T, k*Ht] target features of position t
        position_ids: torch.Tensor,  # [B, T]
        document_ids: torch.Tensor,  # [T] packed-sample id per token
        steps: int = 1,
        feed_drafts: bool = False,
    ) -> list[torch.Tensor]:
        """Draft logits [B, T, D] for each TTT step.

        Step s at position t is the draft of token x_{t+2+s}; its input token is the true
        x_{t+1+s} (the accepted prefix at inference), read from ``input_ids`` shifted left by s.
        Positions whose shifted token falls outside the document see a padding token; their
        outputs are never part of the loss, and no valid position can attend to them. With
        ``feed_drafts`` step s >= 1 reads the drafter's own previous draft instead, as an
        engine does: the same token wherever the earlier drafts were accepted.
        """
        allowed = block_causal_mask(document_ids)
        hidden = self.fc(aux_hidden)
        cache: list[tuple[torch.Tensor, torch.Tensor]] = []
        logits = []
        for s in range(steps):
            if s == 0:
                ids = input_ids
            elif feed_drafts:
                ids = self.draft_to_target[logits[-1].argmax(-1)]
            else:
                ids = F.pad(input_ids[:, s:], (0, s))
            cos, sin = rope_cos_sin(position_ids + s, self.config.head_dim, self.config.rope_theta)
            hidden = self.midlayer(self.embed_tokens(ids), hidden, cos, sin, allowed, cache)
            logits.append(self.lm_head(self.norm(hidden)))
        return logits


class TargetHead(nn.Module):
    """The target's final norm + lm_head, restricted to the draft vocabulary, frozen.

    Turns the stored last-layer state into the target's next-token distribution. If the dataset
    stored that state after the final norm already (``LayerSpec.final_norm``), the norm is skipped:
    applying it twice would silently skew every target.
    """

    def __init__(self, norm_weight, head_weight, eps: float, apply_norm: bool):
        super().__init__()
        self.eps = eps
        self.apply_norm = apply_norm
        self.register_buffer("norm_weight", norm_weight.float())
        self.register_buffer("head_weight", head_weight.float())  # [D, H] rows of draft tokens

    @torch.no_grad()
    def forward(self, last_hidden: torch.Tensor) -> torch.Tensor:
        with torch.autocast(last_hidden.device.type, enabled=False):  # targets in float32
            h = last_hidden.float()
            if self.apply_norm:
                h = rms_norm(h, self.norm_weight, self.eps)
            return h @ self.head_weight.T


# Where families of Hugging Face causal LMs keep the tensors we need (first match wins).
_EMBED_KEYS = ("model.embed_tokens.weight", "embed_tokens.weight", "transformer.wte.weight")
_NORM_KEYS = ("model.norm.weight", "norm.weight", "transformer.ln_f.weight")
_HEAD_KEYS = ("lm_head.weight",)


def load_target_tensors(model_dir: str | Path, want: tuple[str, ...] = ("embed", "norm", "head")):
    """Read only the embedding, final norm and LM head of a local model (safetensors).

    Returns (tensors: dict kind -> tensor, config: dict). Never loads the decoder layers, so a
    70B target costs a few hundred MB here, not its full size.
    """
    folder = ModelFolder(model_dir)
    candidates = {"embed": _EMBED_KEYS, "norm": _NORM_KEYS, "head": _HEAD_KEYS}
    if "head" in want and folder.first(_HEAD_KEYS) is None:
        candidates["head"] = _EMBED_KEYS  # tied embeddings: the head is the embedding matrix
    out = {}
    for kind in want:
        key = folder.first(candidates[kind])
        if key is None:
            raise BadInputError(
                f"none of {candidates[kind]} in the checkpoint", path=str(folder.root)
            )
        out[kind] = folder.tensor(key)
    return out, folder.text_config


def drafter_config_from_target(
    target_config: dict | None,
    *,
    hidden_size: int,
    vocab_size: int,
    num_aux_layers: int,
    draft_vocab_size: int,
    num_heads: int | None = None,
    intermediate_size: int | None = None,
) -> DrafterConfig:
    """Copy the target's attention geometry when we have its config, else pick small defaults."""
    tc = target_config or {}
    heads = num_heads or tc.get("num_attention_heads") or max(1, hidden_size // 32)
    kv = num_heads or tc.get("num_key_value_heads") or heads
    head_dim = tc.get("head_dim") or hidden_size // heads
    rope = tc.get("rope_theta") or (tc.get("rope_parameters") or {}).get("rope_theta") or 10000.0
    return DrafterConfig(
        hidden_size=hidden_size,
        num_aux_layers=num_aux_layers,
        vocab_size=vocab_size,
        draft_vocab_size=min(draft_vocab_size, vocab_size),
        num_attention_heads=heads,
        num_key_value_heads=kv,
        head_dim=head_dim,
        intermediate_size=intermediate_size or tc.get("intermediate_size") or 4 * hidden_size,
        target_hidden_size=hidden_size,
        rms_norm_eps=float(tc.get("rms_norm_eps", 1e-6)),
        rope_theta=float(rope),
        max_position_embeddings=int(tc.get("max_position_embeddings", 4096)),
    )
