"""Foreign formats (readers, writers, registry), convert, re-encode, training integrations."""
