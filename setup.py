"""The one compiled module (the decoder of split-zstd frames); everything else about the package
is in pyproject.toml. Portable C: SSE2 where the compiler targets it (every x86-64)."""

from setuptools import Extension, setup

DECODER = Extension("hsstore.format._split_decoder", sources=["hsstore/format/_split_decoder.c"])
setup(ext_modules=[DECODER])
