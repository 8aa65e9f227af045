"""Extractors: run a target model over prompts and store its hidden states (``hsstore extract``).

Modules, one job each:

* :mod:`hsstore.extract.prompts` - read prompt sets (JSONL chat/ShareGPT/text, .txt, datasets dirs);
* :mod:`hsstore.extract.chat_tokens` - chat template tokenisation and the assistant-only loss mask;
* :mod:`hsstore.extract.layer_select` - ``--layers`` parsing and the default EAGLE-3 choice;
* :mod:`hsstore.extract.transformers_backend` / :mod:`hsstore.extract.sglang_backend` - the models;
* :mod:`hsstore.extract.options` - ``ExtractOptions``, the one definition of a run's options;
* :mod:`hsstore.extract.batching`, :mod:`hsstore.extract.writer_thread`, :mod:`hsstore.extract.worker`,
  :mod:`hsstore.extract.progress`, :mod:`hsstore.extract.runner` - parallel, resumable orchestration.

See docs/EXTRACT.md.
"""

from hsstore.extract.runner import ExtractOptions, run_extract

__all__ = ["ExtractOptions", "run_extract"]
