"""The Storage interface and its backends (local disk, object stores, the local cache),
URLs, read hints and the rule for I/O errors."""
