"""The bytes on disk: paths, the manifest and its schema, layers and conventions, dtypes,
segment layout, Zarr metadata, the sample index."""
