"""The README's plain CMake commands work as written: configure with only torch's CMake prefix (plus
-DCUDA_HOME when torch has CUDA and CUDA_HOME is not in the environment), build, install into a
prefix, and find_package(fox_torch) from that prefix.

The configure is always a fresh one. Building a second tree would compile everything again (minutes;
the whole CUDA code), so by default the build and install steps reuse the package's build
directory (build/cmake, the same sources) where there is one; FOX_TEST_PLAIN_CMAKE_BUILD=1 builds
and installs the fresh tree itself."""
import os
import shutil

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
    log = run([cmake, "-S", REPO_ROOT, "-B", build, "-G", "Ninja", f"-DCMAKE_MAKE_PROGRAM={ninja}",
               f"-DCMAKE_PREFIX_PATH={torch.utils.cmake_prefix_path}", *cuda_home_args()])
    if torch.version.cuda:
        assert "fox_torch: CUDA kernels ON" in log, log

    package_build = REPO_ROOT / "build" / "cmake"
    if os.environ.get("FOX_TEST_PLAIN_CMAKE_BUILD") != "1" and (package_build / "build.ninja").exists():
        build = package_build
    run([cmake, "--build", build], timeout=3600)
    run([cmake, "--install", build, "--prefix", prefix])

    assert (prefix / "lib" / "libfox_torch.so").is_file()
    assert (prefix / "include" / "fox" / "fox.h").is_file()
    package_cmake = prefix / "share" / "cmake" / "fox_torch"
    for name in ("fox_torchConfig.cmake", "fox_torchConfigVersion.cmake", "fox_torchTargets.cmake",
                 "fox_cuda_home.cmake"):
        assert (package_cmake / name).is_file(), name
    assert list(prefix.rglob("_C*.so")), "no _C module installed under the prefix"

    # An app finds the installed package with the same flags (configure only: the consumer is
    # built and run against the Python package by test_cmake_consumer and test_wheel).
    log = run(configure_args(CONSUMER_DIR, tmp_path / "consumer",
                             f"{prefix};{torch.utils.cmake_prefix_path}"))
    assert f"from {package_cmake}" in log, log
