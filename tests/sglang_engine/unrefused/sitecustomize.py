"""Lifts hsstore's refusal of wrongly captured SGLang model classes in every process that starts
with this folder on PYTHONPATH (a CLI run, its workers, their engines), so that one lane test can
show the real engine's states that the refusal keeps out of datasets."""

import hsstore.extractors.backends.sglang.models as _models

_models.WRONG_AUX_CAPTURE.clear()
