"""The README's plain CMake build works as written: configure with only torch's CMake prefix (plus
-DCUDA_HOME when torch has CUDA and CUDA_HOME is not in the environment), build, install into a
prefix, and find_package(fox_torch) from that prefix. With ccache on PATH the build is the package
build's again (same sources and flags: cache hits, then the link); without it, CPU-only to stay
quick."""
import shutil
from pathlib import Path

import pytest
import torch
import torch.utils

from test_cmake_consumer import CONSUMER_DIR, REPO_ROOT, configure_args, cuda_home_args, run

pytestmark = pytest.mark.slow


def test_readme_cmake_build_and_install(tmp_path):
    cmake, ninja = shutil.which("cmake"), shutil.which("ninja")
    if cmake is None or ninja is None:
        pytest.skip("needs cmake and ninja on PATH")
    build, prefix = tmp_path / "build", tmp_path / "prefix"
    args = [cmake, "-S", REPO_ROOT, "-B", build, "-G", "Ninja", f"-DCMAKE_MAKE_PROGRAM={ninja}",
            f"-DCMAKE_PREFIX_PATH={torch.utils.cmake_prefix_path}", *cuda_home_args()]
    if shutil.which("ccache") is None:
        args.append("-DFOX_ENABLE_CUDA=OFF")
    log = run(args)
    run([cmake, "--build", build], timeout=1800)
    run([cmake, "--install", build, "--prefix", prefix])

    libs = sorted(p.name for p in (prefix / "lib").glob("libfox_torch.so*"))
    assert libs == ["libfox_torch.so", "libfox_torch.so.0", "libfox_torch.so.0.1.0"], libs
    assert (prefix / "include" / "fox" / "fox.h").is_file()
    package_cmake = prefix / "share" / "cmake" / "fox_torch"
    for name in ("fox_torchConfig.cmake", "fox_torchConfigVersion.cmake", "fox_torchTargets.cmake",
                 "fox_cuda_home.cmake"):
        assert (package_cmake / name).is_file(), name
    assert list((prefix / "lib" / "fox_torch" / "python").glob("_C*.so"))
    if torch.version.cuda and "-DFOX_ENABLE_CUDA=OFF" not in args:
        assert "CUDA kernels ON" in log, log

    # An app finds the installed package with the same flags (configure only: the consumer is
    # built and run against the Python package by test_cmake_consumer).
    prefix_path = f"{prefix};{torch.utils.cmake_prefix_path}"
    log = run(configure_args(CONSUMER_DIR, tmp_path / "consumer", prefix_path))
    assert f"from {package_cmake}" in log, log
