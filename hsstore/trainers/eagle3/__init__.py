"""A small, readable EAGLE-3 drafter trainer on top of the hsstore loader (docs/TRAINER.md)."""

from hsstore.trainers.eagle3.model import DrafterConfig, Eagle3Drafter, TargetHead
from hsstore.trainers.eagle3.vocab import VocabMaps, build_vocab_maps, count_tokens

__all__ = [
    "DrafterConfig",
    "Eagle3Drafter",
    "TargetHead",
    "VocabMaps",
    "build_vocab_maps",
    "count_tokens",
]
