"""The planning half of the runtime, and the planner on top of it, import without torch.

Run in a fresh interpreter: this test process has long imported torch through other tests.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

PLANNING_MODULES = (
    "planner.api", "planner.simulate", "planner.cost", "planner.replan",
)


def run_without_torch(body: str) -> subprocess.CompletedProcess:
    """Run ``body`` (which sets ``names``, the modules it imported) in a fresh interpreter; it exits 1 when
    torch was loaded."""
    code = ("import importlib, pkgutil, sys\n" + body +
            "loaded = sorted(m for m in sys.modules if m == 'torch' or m.startswith('torch.'))\n"
            "print(len(names), loaded[:5])\n"
            "sys.exit(1 if loaded or len(names) < 4 else 0)\n")
    env = {**os.environ, "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    return subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=120)


def test_planning_modules_never_load_torch() -> None:
    res = run_without_torch(f"names = {PLANNING_MODULES!r}\n"
                            "for m in names:\n"
                            "    importlib.import_module(m)\n")
    assert res.returncode == 0, f"torch was imported: {res.stdout.strip()} {res.stderr.strip()[-2000:]}"


def test_every_module_of_the_torch_free_package_imports_without_torch() -> None:
    res = run_without_torch("import runtime.torchfree as pkg\n"
                            "names = [m.name for m in pkgutil.walk_packages(pkg.__path__, pkg.__name__ + '.')]\n"
                            "assert len(names) >= 10, names\n"
                            "for m in names:\n"
                            "    importlib.import_module(m)\n")
    assert res.returncode == 0, f"torch was imported: {res.stdout.strip()} {res.stderr.strip()[-2000:]}"
