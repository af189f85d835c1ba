"""The built wheel ships the stylesheet and the kernels' C sources: install it into a fresh venv, start the app
headless from there and build the compiled CPU decode layer (every source and the header) from its files.

The venv sees the test interpreter's site-packages (torch, textual, …) but the test runs
from a directory outside the checkout and checks that ``kvchat`` came from the
venv's own site-packages, so a stylesheet missing from the wheel fails here
even though the checkout has it.
"""

from __future__ import annotations

import json
import os
import shutil
import site
import subprocess
import sys
import venv
from pathlib import Path

from kvchat.kernels import cpu_decode

REPO = Path(__file__).resolve().parents[1]

CHILD = r"""
import asyncio, json, sys
import kvchat.tui.app as app_module
from kvchat.tui.app import KvchatApp
from kvchat.tui.fake_backend import FakeBackend

async def main():
    app = KvchatApp(FakeBackend())
    async with app.run_test(size=(100, 30)) as pilot:
        await pilot.pause(0.3)
        sidebar = app.screen_stack[0].query_one("#sidebar")
        status = app.screen_stack[0].query_one("#status")
        print(json.dumps({
            "module": app_module.__file__,
            "css": str(app_module.CSS_FILE),
            "sidebar_width": sidebar.outer_size.width,
            "status_height": status.outer_size.height,
        }))

asyncio.run(main())
from kvchat.kernels import cpu_decode
print(json.dumps({"kernel_source": str(cpu_decode.SOURCE), "kernel_built": cpu_decode.available()}))
"""


def _see_this_interpreters_packages(python: Path) -> None:
    """Let the child venv import torch, textual, … from the interpreter running the tests.

    ``system_site_packages=True`` would point at the *base* interpreter's
    packages, which lack them when the tests run in a venv (as a user runs
    the README's command). A ``.pth`` line adds each directory to the path
    without running the ``.pth`` files in it, so an editable install of
    kvchat there is not seen: only the wheel in the child's own site-packages.
    """
    child_site = subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                                check=True, capture_output=True, text=True).stdout.strip()
    Path(child_site, "parent-packages.pth").write_text("\n".join(site.getsitepackages()) + "\n")


def _child_env(tmp_path: Path) -> dict[str, str]:
    """A bare environment, but for what decides whether the kernels build here (the compiler, its switch),
    and a fresh cache dir, so the kernels are built from the wheel's own sources."""
    cc = shutil.which("cc") or shutil.which("gcc")
    env = {"KVCHAT_HOME": str(tmp_path / "home"), "XDG_CACHE_HOME": str(tmp_path / "cache"),
           "PATH": ":".join(dict.fromkeys([*([os.path.dirname(cc)] if cc else []), "/usr/bin", "/bin"]))}
    return env | {k: os.environ[k] for k in ("CC", "KVCHAT_CPU_KERNEL") if k in os.environ}


def test_wheel_ships_the_stylesheet_and_the_app_starts_from_it(tmp_path):
    dist = tmp_path / "dist"
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(dist),
                    str(REPO)], check=True, capture_output=True, timeout=120)
    [wheel] = dist.glob("kvchat-*.whl")
    env_dir = tmp_path / "venv"
    venv.EnvBuilder(system_site_packages=False, with_pip=False).create(env_dir)
    python = env_dir / "bin" / "python"
    _see_this_interpreters_packages(python)
    subprocess.run([sys.executable, "-m", "pip", "--python", str(python), "install", "--no-deps", "-q", str(wheel)],
                   check=True, capture_output=True, timeout=120)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    proc = subprocess.run([str(python), "-c", CHILD], check=False, cwd=elsewhere, capture_output=True, text=True, timeout=120,
                          env=_child_env(tmp_path))
    assert proc.returncode == 0, proc.stderr[-2000:]
    lines = proc.stdout.strip().splitlines()
    facts, kernel = json.loads(lines[-2]), json.loads(lines[-1])
    site = env_dir / "lib"
    assert Path(facts["module"]).is_relative_to(site) and not Path(facts["module"]).is_relative_to(REPO)
    assert Path(facts["css"]).is_relative_to(site) and Path(facts["css"]).is_file()
    assert facts["sidebar_width"] == 36 and facts["status_height"] == 2  # values from kvchat.tcss
    assert Path(kernel["kernel_source"]).is_relative_to(site)
    # where this machine builds the kernels (a C compiler, AVX2), the wheel's files alone build them too
    assert kernel["kernel_built"] == cpu_decode.available()
