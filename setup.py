"""The compiled part of kvtier: the fs tier's chunk-file I/O (everything else
is in pyproject.toml). ``optional``: without a C compiler the build goes on
and the fs tier runs the same I/O in Python."""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "kvtier.tiers.fs._native._chunkio",
            ["src/kvtier/tiers/fs/_native/_chunkio.c"],
            optional=True,
        )
    ]
)
