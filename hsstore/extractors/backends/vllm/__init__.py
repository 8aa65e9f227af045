"""The vLLM engine backend: states captured by a forward hook in vLLM's workers into
shared-memory slots."""
