"""What a dataset IS: manifest, layer semantics, file names, storage and the atomic commit."""
