"""The conformance zoo: real architectures from libraries nobody here wrote, run through
``ap_backend.precompile`` + ``autoparallel_backend`` with FSDP-style sharded parameters.

``python -m zoo`` runs it (see ``zoo/README.md``); ``tests/test_zoo.py`` runs a fast subset.
"""
