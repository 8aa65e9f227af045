"""The SGLang engine backend: states captured inside the engine into shared-memory slots."""
