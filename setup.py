"""Build hook for the optional C extensions (everything else is in pyproject.toml).

``cpd.kv._chain_sha256`` (the chained per-block SHA-256 of ``cpd.kv.block_hash`` over OpenSSL's
libcrypto) and ``cpd.router._mask_walk`` (the prefix walk of ``cpd.router.mask_table``) are
``optional``: without a C compiler, Python headers or (for the first) the OpenSSL headers
(Debian: ``gcc python3-dev libssl-dev``, see the Makefile's ``builddeps``) the build prints a
warning and installs the package without them, and the modules use their Python paths.
"""
from setuptools import Extension, setup

setup(ext_modules=[
    Extension("cpd.kv._chain_sha256", sources=["cpd/kv/_chain_sha256.c"], libraries=["crypto"],
              optional=True),
    Extension("cpd.router._mask_walk", sources=["cpd/router/_mask_walk.c"], optional=True),
])
