"""Extractors: run a target model over prompts and store its hidden states (``hsstore extract``).

Modules, one job each:

* :mod:`extractors.prompts` - read prompt sets (JSONL chat/ShareGPT/text, .txt, datasets dirs);
* :mod:`extractors.chat_tokens` - chat template tokenisation and the assistant-only loss mask;
* :mod:`extractors.layer_select` - ``--layers`` parsing and the default EAGLE-3 choice;
* :mod:`extractors.transformers_backend` / :mod:`extractors.sglang_backend` - the models;
* :mod:`extractors.batching`, :mod:`extractors.writer_thread`, :mod:`extractors.worker`,
  :mod:`extractors.progress`, :mod:`extractors.runner` - parallel, resumable orchestration.

See docs/EXTRACT.md.
"""

from extractors.runner import ExtractOptions, run_extract

__all__ = ["ExtractOptions", "run_extract"]
