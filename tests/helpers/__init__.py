"""Helpers shared by the test modules, imported as ``helpers.<module>``.

``tests/`` is on ``sys.path`` through pytest's ``pythonpath`` setting (``pyproject.toml``), and
``torch.multiprocessing.spawn`` hands the parent's ``sys.path`` to its workers, so the worker bodies here import
the same way in every process. Nothing here is collected as a test.
"""
