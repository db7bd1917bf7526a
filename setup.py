"""Build hook for the one optional C extension (everything else is in pyproject.toml).

``cpd.kv._chain_sha256`` (the chained per-block SHA-256 of ``cpd.kv.block_hash`` over OpenSSL's
libcrypto) is ``optional``: without a C compiler, Python headers or the OpenSSL headers
(Debian: ``gcc python3-dev libssl-dev``, see the Makefile's ``builddeps``) the build prints a
warning and installs the package without it, and ``block_hash`` uses its pure-Python loop.
"""
from setuptools import Extension, setup

setup(ext_modules=[
    Extension("cpd.kv._chain_sha256", sources=["cpd/kv/_chain_sha256.c"], libraries=["crypto"],
              optional=True),
])
