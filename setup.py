"""The compiled parts of kvtier: the fs tier's chunk-file I/O, the primary
tier's per-chunk loops and the cache policies' per-key steps (everything else is in
pyproject.toml). ``optional``: without a C compiler the build goes on and
each runs the same code in Python."""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "kvtier.tiers.fs._native._chunkio",
            ["src/kvtier/tiers/fs/_native/_chunkio.c"],
            # dlopen/dlsym (binding xxhash's XXH3): in libc itself since glibc
            # 2.34, in libdl before.
            libraries=["dl"],
            optional=True,
        ),
        Extension(
            "kvtier.primary._native._slots",
            ["src/kvtier/primary/_native/_slots.c"],
            optional=True,
        ),
        Extension(
            "kvtier.policies._native._steps",
            ["src/kvtier/policies/_native/_steps.c"],
            optional=True,
        ),
    ]
)
