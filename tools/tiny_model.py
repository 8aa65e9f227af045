"""The tiny test model, for scripts and tests run from the repository (it lives in the library)."""

from hsstore.demo_model import CHAT_TEMPLATE, SPECIAL_TOKENS, build_tiny_model

__all__ = ["CHAT_TEMPLATE", "SPECIAL_TOKENS", "build_tiny_model"]
