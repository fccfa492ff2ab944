"""Build the optional C helpers; everything else is declared in pyproject.toml.

``optional=True``: without a C compiler the install still succeeds and the codec uses its
pure-Python path (``dynamo_tiered_kv._native.fast.AVAILABLE`` is False, logged as a warning and
exported as ``dtkv_codec_fast_path`` 0).

``xxhash.h`` is the vendored single-header xxHash (BSD-2, license at its top): it ships in the
sdist (MANIFEST.in) so the extension builds from it, and in the wheel as package data so the
license travels with the compiled code.
"""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "dynamo_tiered_kv._native._fastcodec",
            ["dynamo_tiered_kv/_native/fastcodec.c"],
            depends=["dynamo_tiered_kv/_native/xxhash.h", "dynamo_tiered_kv/_native/xxh3_dispatch.h"],
            include_dirs=["dynamo_tiered_kv/_native"],
            extra_compile_args=["-O3"],
            optional=True,
        )
    ],
    package_data={"dynamo_tiered_kv._native": ["xxhash.h", "xxh3_dispatch.h", "fastcodec.c"]},
)
