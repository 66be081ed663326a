"""The installed package is usable from CMake: configure and build tests/cpp/consumer (a tiny app
that does find_package(fox_torch) and links fox::fox_torch) against the installed
forgetting_transformer package and torch, run it, and check what it prints against the same
computation done here through torch.ops.fox."""
import math
import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import torch
import torch.utils

import forgetting_transformer

pytestmark = pytest.mark.slow

REPO_ROOT = Path(__file__).resolve().parents[2]
CONSUMER_DIR = REPO_ROOT / "tests" / "cpp" / "consumer"


def run(cmd, cwd=None, timeout=300):
    proc = subprocess.run(
        [str(c) for c in cmd], cwd=cwd, capture_output=True, text=True, timeout=timeout
    )
    assert proc.returncode == 0, (
        f"command failed ({proc.returncode}): {' '.join(map(str, cmd))}\n"
        f"--- stdout ---\n{proc.stdout[-6000:]}\n--- stderr ---\n{proc.stderr[-6000:]}"
    )
    return proc.stdout


def cuda_home_args() -> list:
    """What a CUDA-enabled LibTorch needs to be found: nothing when CUDA_HOME is in the environment
    (as .ci/env.sh exports it), else the one flag -DCUDA_HOME (fox_torchConfig.cmake derives the
    rest), here pointing at the toolkit .ci/env.sh assembles in build/cuda-toolkit."""
    if not torch.version.cuda or os.environ.get("CUDA_HOME"):
        return []
    assembled = REPO_ROOT / "build" / "cuda-toolkit"
    if not (assembled / "bin" / "nvcc").exists():
        pytest.skip("torch has CUDA: set CUDA_HOME to a CUDA toolkit for find_package(Torch) "
                    "(source .ci/env.sh)")
    return [f"-DCUDA_HOME={assembled}"]


def configure_args(src: Path, build: Path, prefix_path=None) -> list:
    """cmake's configure command line for an app on the installed package: the README's flags
    (CMAKE_PREFIX_PATH = the package's and torch's CMake directories), no C++ standard, no CUDA
    settings beyond cuda_home_args()."""
    cmake, ninja = shutil.which("cmake"), shutil.which("ninja")
    if cmake is None or ninja is None:
        pytest.skip("needs cmake and ninja on PATH")
    if prefix_path is None:
        prefix_path = ";".join([forgetting_transformer.cmake_prefix_path,
                                torch.utils.cmake_prefix_path])
    return [
        cmake, "-G", "Ninja", "-S", src, "-B", build,
        f"-DCMAKE_MAKE_PROGRAM={ninja}",
        f"-DCMAKE_PREFIX_PATH={prefix_path}",
        "-DCMAKE_BUILD_TYPE=Release",
        *cuda_home_args(),
    ]


def expected_sums():
    """What the consumer computes (same seed and calls), done through torch.ops.fox."""
    B, T, H, Hkv, D = 2, 37, 4, 2, 32
    torch.manual_seed(0)
    q = torch.randn(B, T, H, D).requires_grad_()
    k = torch.randn(B, T, Hkv, D).requires_grad_()
    v = torch.randn(B, T, Hkv, D).requires_grad_()
    g = torch.nn.functional.logsigmoid(torch.randn(B, T, H) + 2.0).detach().requires_grad_()
    out = torch.ops.fox.forgetting_attention(q, k, v, g)
    out.pow(2).sum().backward()
    return out.sum().item(), [x.grad.sum().item() for x in (q, k, v, g)]


def build_and_run_consumer(build: Path, package_dir: Path, prefix_path: str, with_cuda: bool) -> str:
    """Configure and build tests/cpp/consumer against the package in package_dir (its CMake
    directory first on prefix_path), check it found and links that package, run it, and check its
    numbers against torch.ops.fox here. Returns the configure log."""
    package_cmake = package_dir / "share" / "cmake" / "fox_torch"
    assert (package_cmake / "fox_torchConfig.cmake").is_file(), "the package has no CMake config"
    configure_log = run(configure_args(CONSUMER_DIR, build, prefix_path))
    # It found the installed package, not some other copy.
    found = re.search(r"fox_torch \S+ from (\S+)", configure_log)
    assert found, configure_log
    assert Path(found.group(1)).resolve() == package_cmake.resolve()

    run([shutil.which("cmake"), "--build", build, "--parallel", "2"])
    exe = build / "fox_consumer"
    assert exe.is_file()
    # Its libfox_torch is the package's (RPATH from the imported target).
    ldd = shutil.which("ldd")
    if ldd is not None:
        libs = run([ldd, exe])
        line = next((l for l in libs.splitlines() if "libfox_torch" in l), "")
        assert "not found" not in line and line, libs
        lib_path = Path(line.split("=>")[1].split("(")[0].strip()).resolve()
        assert lib_path.parent == (package_dir / "lib").resolve()

    stdout = run([exe], timeout=120)
    assert "fox_consumer: OK" in stdout, stdout
    values = dict(re.findall(r"^(\w+)=(.*)$", stdout, flags=re.M))
    assert int(values["built_with_cuda"]) == int(with_cuda)
    out_sum = float(values["out_sum"])
    grad_sums = [float(x) for x in values["grad_sums"].split()]
    assert all(math.isfinite(x) for x in [out_sum, *grad_sums])

    expected_out, expected_grads = expected_sums()
    assert out_sum == pytest.approx(expected_out, rel=1e-6, abs=1e-6)
    assert grad_sums == pytest.approx(expected_grads, rel=1e-5, abs=1e-4)
    return configure_log


def test_cmake_consumer(tmp_path):
    if os.environ.get("FOX_TEST_INSTALLED") == "1" and any((REPO_ROOT / "dist").glob("*.whl")):
        # tests/run.sh: this package is the wheel's, in .venv; test_wheel builds the same app
        # against the same wheel in a fresh environment (the build is the slow part).
        pytest.skip("test_wheel builds the consumer against the installed wheel")
    build_and_run_consumer(tmp_path / "build", Path(forgetting_transformer.__file__).parent,
                           None, forgetting_transformer.built_with_cuda())


def test_example_train_tiny(tmp_path):
    """examples/train_tiny, built against the installed package: the loss falls and it
    generates text."""
    build = tmp_path / "build"
    run(configure_args(REPO_ROOT / "examples" / "train_tiny", build))
    run([shutil.which("cmake"), "--build", build, "--parallel", "2"])
    stdout = run([build / "fox_train_tiny", "40"], timeout=300)
    values = dict(re.findall(r"^(\w+)=(.*)$", stdout, flags=re.M))
    first, last = float(values["first_loss"]), float(values["last_loss"])
    assert last < 0.8 * first, stdout
    generated = re.search(r"^generated: (.*)$", stdout, flags=re.M)
    assert generated and generated.group(1).startswith("The forget gate "), stdout
    assert len(generated.group(1).encode("latin-1", "replace")) > len("The forget gate ")
