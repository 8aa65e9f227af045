"""Extractors: run a target model over prompts and store its hidden states (``hsstore extract``).

Modules, one job each:

* :mod:`hsstore.extractors.prompts` - read prompt sets (JSONL chat/ShareGPT/text, .txt, datasets dirs);
* :mod:`hsstore.extractors.chat_tokens` - chat template tokenisation and the assistant-only loss mask;
* :mod:`hsstore.extractors.layer_select` - ``--layers`` parsing and the default EAGLE-3 choice;
* :mod:`hsstore.extractors.backends.transformers` / :mod:`hsstore.extractors.backends.sglang.backend` - the models;
* :mod:`hsstore.extractors.options` - ``ExtractOptions``, the one definition of a run's options;
* :mod:`hsstore.extractors.batching`, :mod:`hsstore.extractors.writer_thread`, :mod:`hsstore.extractors.worker`,
  :mod:`hsstore.extractors.progress`, :mod:`hsstore.extractors.runner` - parallel, resumable orchestration.

See docs/EXTRACT.md.
"""

from hsstore.extractors.runner import ExtractOptions, run_extract

__all__ = ["ExtractOptions", "run_extract"]
