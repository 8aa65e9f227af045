"""The compiled modules (the decoder of split-zstd frames, many XXH3 digests in one call, many
file ranges read in one call); everything else about the package is in pyproject.toml.
Portable C: SSE2 where the compiler targets it (every x86-64)."""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension("hsstore.codec._split_decoder", sources=["hsstore/codec/_split_decoder.c"]),
        Extension("hsstore.spec._xxh3_many", sources=["hsstore/spec/_xxh3_many.c"]),
        Extension("hsstore.storage._pread_many", sources=["hsstore/storage/_pread_many.c"]),
    ]
)
