"""Shared test set-up.

``TRITON_INTERPRET`` must be set before any ``@triton.jit`` kernel module is imported (Triton reads
it at decoration time), so it is set here, before the package is imported by any test module.
"""

from __future__ import annotations

import os
import re
from pathlib import Path


os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402
from helpers.fixtures import fixtures_root  # noqa: E402


# The golden fixtures were produced with one thread; fp32 bit-level agreement assumes it.
torch.set_num_threads(1)


def pytest_configure(config: pytest.Config) -> None:
    """Refuse, before any test runs, an environment whose Triton interpreter cannot run the kernels: Triton 3.6's
    calls ``int()`` on one-element arrays, which numpy 2.4 refuses (every kernel test would fail on it)."""
    from importlib.metadata import version

    triton_version, numpy_version = version("triton"), version("numpy")
    minor = lambda v: tuple(int(part) for part in v.split(".")[:2])  # noqa: E731
    if minor(triton_version) < (3, 7) and minor(numpy_version) >= (2, 4):
        raise pytest.UsageError(
            f"triton {triton_version} runs the suite's Triton kernels in a CPU interpreter that needs numpy < 2.4 "
            f"(this environment has {numpy_version}): pip install 'numpy<2.4' (tests/benchmarks/"
            "check_version_floor.sh does)"
        )


@pytest.fixture(scope="session")
def fixtures_dir() -> Path:
    """Root of the read-only golden fixtures (``$MAGI2_FIXTURES`` or ``../shared/fixtures`` beside the checkout)."""
    root = fixtures_root()
    if not root.is_dir():
        pytest.fail(f"golden fixtures not found at {root}; set MAGI2_FIXTURES")
    return root


@pytest.fixture(autouse=True)
def _restore_active_attention_backend():
    """Undo diffusers' process-wide attention backend after each test.

    ``ModelMixin.set_attention_backend`` also sets the registry's *active* backend, which every processor without
    its own backend dispatches to; a test that picks ``_native_math`` would otherwise change the attention (its
    numerics and its memory) of every later test in the process.
    """
    from diffusers.models.attention_dispatch import _AttentionBackendRegistry

    saved = _AttentionBackendRegistry._active_backend
    yield
    _AttentionBackendRegistry.set_active_backend(saved)


_DISTRIBUTED_MARK = re.compile(r"\bmark\.distributed\b")
_HOST_MEMORY_MARK = re.compile(r"\bmark\.host_memory_checks\b")
_SLOW_MARK = re.compile(r"\bmark\.slow\b")


@pytest.fixture(scope="session")
def host_memory_checks(request, tmp_path_factory) -> dict:
    """Every selected test's fresh-process host-memory checks (its ``host_memory_checks`` mark), run once for the
    session, each forked from one new interpreter (``helpers.fresh_interpreter.run_host_memory_checks``): name to
    ``subprocess.CompletedProcess``."""
    from helpers.fresh_interpreter import run_host_memory_checks

    return run_host_memory_checks(request.session.items, tmp_path_factory.mktemp("host_memory_checks"))


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    """pytest-xdist's work units under ``-n N`` (``--dist load``, the default): each test module is one unit (its
    cached models and module fixtures are built once), and every module that holds a ``distributed`` test joins one
    unit, so the multi-process tests run one after another on one worker: never two gloo groups or launches at
    once, and that worker's pools of gloo ranks (``helpers.ep_spawn_utils``) serve them all; every module that holds
    a ``host_memory_checks`` mark joins another, so the session fixture of that name runs its checks once. A free
    worker takes the costliest unit left (the distributed unit, then units with a ``slow`` test, then by number of
    tests), so no long module starts last while the other worker idles. The scheduler sees node ids only, so a
    module's source is what tells it the module's marks."""
    if config.getvalue("dist") != "load":
        return None
    from xdist.scheduler import LoadScopeScheduling

    root = config.rootpath
    marks: dict[str, tuple[bool, bool, bool]] = {}

    def module_marks(module: str) -> tuple[bool, bool, bool]:
        """``(distributed, slow, host_memory_checks)``: whether the module's source marks a test so."""
        if module not in marks:
            path = root / module
            source = path.read_text() if path.is_file() else ""
            marks[module] = tuple(bool(m.search(source)) for m in (_DISTRIBUTED_MARK, _SLOW_MARK, _HOST_MEMORY_MARK))
        return marks[module]

    class ModuleScheduling(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            module = nodeid.split("::", 1)[0]
            distributed, _, host_memory = module_marks(module)
            return "distributed" if distributed else "host_memory_checks" if host_memory else module

        def _assign_work_unit(self, node) -> None:
            def cost(scope: str) -> tuple[bool, bool, int]:
                unit = [module_marks(nodeid.split("::", 1)[0]) for nodeid in self.workqueue[scope]]
                return any(m[0] for m in unit), any(m[1] for m in unit), len(unit)

            self.workqueue.move_to_end(max(self.workqueue, key=cost), last=False)
            super()._assign_work_unit(node)

    return ModuleScheduling(config, log)
