"""Build the optional C helpers; everything else is declared in pyproject.toml.

``optional=True``: without a C compiler the install still succeeds and the codec uses its
pure-Python path (``dynamo_tiered_kv._native.fast.AVAILABLE`` is False).
"""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "dynamo_tiered_kv._native._fastcodec",
            ["dynamo_tiered_kv/_native/fastcodec.c"],
            extra_compile_args=["-O3"],
            optional=True,
        )
    ]
)
