"""Helpers shared by the test modules, imported as ``helpers.<module>``.

``tests/`` is on ``sys.path`` through pytest's ``pythonpath`` setting (``pyproject.toml``), and
``torch.multiprocessing`` hands the parent's ``sys.path`` to the gloo workers it starts (``ep_spawn_utils``), so
the worker bodies here import the same way in every process. Nothing here is collected as a test.
"""
