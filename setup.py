"""The one compiled module (the byte-plane join of split-zstd chunks); everything else about the
package is in pyproject.toml. Portable C: SSE2 where the compiler targets it (every x86-64)."""

from setuptools import Extension, setup

setup(ext_modules=[Extension("hsstore.format._planes", sources=["hsstore/format/_planes.c"])])
