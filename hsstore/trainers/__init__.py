"""Reference trainers fed by ``hsstore.loader`` (not part of the core library)."""
