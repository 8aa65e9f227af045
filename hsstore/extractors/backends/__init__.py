"""The engines that run a model and capture its states: transformers, SGLang."""
