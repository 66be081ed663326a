"""bench/kernel_ab.sh, the build of the in-process comparison of two builds of the Hopper kernels
(A from a git revision, B from the working tree): it compiles and links (running it needs an H100 or
H200), names what it compared, and refuses an unknown option with its usage."""
import os
import shutil
import subprocess

import pytest

from test_cmake_consumer import REPO_ROOT

pytestmark = pytest.mark.slow

SCRIPT = REPO_ROOT / "bench" / "kernel_ab.sh"


def nvcc_dir():
    home = os.environ.get("CUDA_HOME")
    candidates = [os.path.join(home, "bin")] if home else []
    found = shutil.which("nvcc")
    if found:
        candidates.append(os.path.dirname(found))
    for d in candidates:
        if os.path.isfile(os.path.join(d, "nvcc")):
            return d
    pytest.skip("needs nvcc (CUDA_HOME or PATH)")


def cutlass_include():
    cutlass_library = pytest.importorskip("cutlass_library")
    path = os.path.join(os.path.dirname(cutlass_library.__file__), "source", "include")
    if not os.path.isfile(os.path.join(path, "cute", "arch", "mma_sm90_gmma.hpp")):
        pytest.skip("the nvidia-cutlass wheel has no CUTLASS headers")
    return path


def test_kernel_ab_builds_against_head(tmp_path):
    if not (REPO_ROOT / ".git").exists():
        pytest.skip("needs the git checkout (build A comes from a revision)")
    env = dict(os.environ, PATH=f"{nvcc_dir()}{os.pathsep}{os.environ['PATH']}",
               FOX_CUTLASS_INCLUDE_DIR=cutlass_include())
    out = tmp_path / "ab"
    result = subprocess.run(["bash", str(SCRIPT), "--base", "HEAD", "--out", str(out), "--",
                             "-DFOX_SECTION_MIB_QUERY_BLOCKS=24"],
                            env=env, capture_output=True, text=True, timeout=3600)
    assert result.returncode == 0, result.stdout + result.stderr
    assert out.is_file() and os.access(out, os.X_OK)
    assert "B = the working tree (-DFOX_SECTION_MIB_QUERY_BLOCKS=24)" in result.stdout, result.stdout


def test_kernel_ab_refuses_an_unknown_option():
    result = subprocess.run(["bash", str(SCRIPT), "--bogus"], capture_output=True, text=True, timeout=60)
    assert result.returncode == 2
    assert "--base REV" in result.stderr
