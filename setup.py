"""The compiled modules (the decoder of split-zstd frames, many XXH3 digests in one call, many
file ranges read in one call); everything else about the package is in pyproject.toml.
Portable C: SSE2 where the compiler targets it (every x86-64).

The decoder links libzstd and the digests compile in xxHash (its header-only mode), through
their public C APIs (headers from the system: Debian's libzstd-dev and libxxhash-dev, which
scripts/install.sh installs).
Both are optional: where a library or its header is missing the build goes on without that
module, and hsstore decodes and hashes through numcodecs, zstandard and xxhash instead (the
portable path, docs/PERFORMANCE.md)."""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "hsstore.codec._split_decoder",
            sources=["hsstore/codec/_split_decoder.c"],
            depends=["hsstore/codec/byte_planes.h"],
            libraries=["zstd"],
            optional=True,
        ),
        Extension(
            "hsstore.spec._xxh3_many",
            sources=["hsstore/spec/_xxh3_many.c"],
            depends=["hsstore/codec/byte_planes.h"],
            optional=True,
        ),
        Extension("hsstore.storage._pread_many", sources=["hsstore/storage/_pread_many.c"]),
    ]
)
