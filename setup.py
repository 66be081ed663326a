"""Thin driver of the CMake build: configures against the installed torch, builds with Ninja and
installs libfox_torch, the _C module, the headers and the CMake package into the Python package.

Environment knobs: TORCH_CUDA_ARCH_LIST (default "8.0;9.0a"), CUDA_HOME (a CUDA toolkit root),
FOX_BUILD_TESTS=1 (also build the Catch2 tests; .ci/setup.sh sets it), FOX_BUILD_BENCH=1 (also
build bench/'s CUDA programs; follows FOX_BUILD_TESTS unless set), FOX_UNITY_BUILD=0 (compile
the C++ sources one by one: quicker rebuilds after editing one of them), FOX_BUILD_DIR (default
build/cmake), MAX_JOBS.

A wheel (CUDA kernels, headers and CMake package inside; torch from the environment):
    pip wheel --no-build-isolation --no-deps -w dist .
"""
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

ROOT = Path(__file__).parent.resolve()


class CMakeExtension(Extension):
    def __init__(self, name):
        super().__init__(name, sources=[])


def drop_cache_on_new_cuda_compiler(build_dir: Path, nvcc: str) -> None:
    """CMake cannot switch compilers in a configured tree: given a new CMAKE_CUDA_COMPILER it wipes
    its cache and configures again without this command's -D options, and then cannot find Torch.
    A fresh cache instead (CUDA_HOME moved); the objects and ninja's log keep the build incremental."""
    cache = build_dir / "CMakeCache.txt"
    if not cache.exists():
        return
    for line in cache.read_text().splitlines():
        if line.startswith("CMAKE_CUDA_COMPILER:"):
            if line.split("=", 1)[1] != nvcc:
                cache.unlink()
                shutil.rmtree(build_dir / "CMakeFiles", ignore_errors=True)
            return


def clear_installed(package_dir: Path) -> None:
    """Remove what an earlier install put into the package directory (other SONAMEs, headers of
    deleted files): a wheel then holds exactly this build's install, and build_py's copies of an
    editable install's files in the source tree do not linger in it."""
    for sub in ("lib", "include", "share"):
        shutil.rmtree(package_dir / sub, ignore_errors=True)
    for module in package_dir.glob("_C*.so"):
        module.unlink()


def _version(text: str) -> tuple:
    return tuple(int(x) for x in re.findall(r"\d+", text)[:2])


def check_build_tools() -> None:
    """A missing or too old build tool stops the build with one line that names it (pip's build
    isolation is off in the documented commands, so nothing installs them for us)."""
    try:
        import torch
    except ImportError:
        sys.exit("fox_torch: building needs torch >= 2.6 installed first (pip install torch), then "
                 "pip install --no-build-isolation .")
    if _version(torch.__version__) < (2, 6):
        sys.exit(f"fox_torch: building needs torch >= 2.6, found {torch.__version__}")
    cmake = shutil.which("cmake")
    if cmake is None:
        sys.exit("fox_torch: building needs CMake >= 3.24 on PATH (pip install cmake)")
    found = subprocess.run([cmake, "--version"], capture_output=True, text=True).stdout
    if _version(found) < (3, 24):
        sys.exit(f"fox_torch: building needs CMake >= 3.24, found {found.splitlines()[0]} "
                 "(pip install cmake)")
    if shutil.which("ninja") is None:
        sys.exit("fox_torch: building needs Ninja on PATH (pip install ninja)")


class CMakeBuild(build_ext):
    def build_extension(self, ext):
        check_build_tools()
        import torch

        package_dir = Path(self.get_ext_fullpath(ext.name)).parent.resolve()
        # A fixed build directory keeps rebuilds incremental (editable installs included).
        build_dir = Path(os.environ.get("FOX_BUILD_DIR", ROOT / "build" / "cmake")).resolve()
        build_dir.mkdir(parents=True, exist_ok=True)
        args = [
            "-G", "Ninja",
            f"-DCMAKE_BUILD_TYPE={os.environ.get('CMAKE_BUILD_TYPE', 'Release')}",
            f"-DCMAKE_PREFIX_PATH={torch.utils.cmake_prefix_path}",
            f"-DPython_EXECUTABLE={sys.executable}",
            f"-DCMAKE_INSTALL_PREFIX={package_dir}",
            "-DCMAKE_INSTALL_LIBDIR=lib",
            "-DFOX_PYTHON_INSTALL_DIR=.",
            f"-DFOX_BUILD_TESTS={'ON' if os.environ.get('FOX_BUILD_TESTS') == '1' else 'OFF'}",
            f"-DFOX_BUILD_BENCH={'ON' if os.environ.get('FOX_BUILD_BENCH', os.environ.get('FOX_BUILD_TESTS')) == '1' else 'OFF'}",
            f"-DFOX_ENABLE_CUDA={'OFF' if os.environ.get('FOX_ENABLE_CUDA') == '0' else 'ON'}",
            f"-DTORCH_CUDA_ARCH_LIST={os.environ.get('TORCH_CUDA_ARCH_LIST', '8.0;9.0a')}",
            # Unity build: each target's C++ sources in a few batches, which pay once for the
            # LibTorch headers and the templates they instantiate (most of each source's compile
            # time): a full build takes far less CPU time. CUDA sources stay one nvcc job each.
            f"-DCMAKE_UNITY_BUILD={'OFF' if os.environ.get('FOX_UNITY_BUILD') == '0' else 'ON'}",
            # One plain libfox_torch.so: a wheel cannot hold the versioned names' symlinks.
            "-DFOX_VERSIONED_LIBRARY=OFF",
        ]
        cuda_home = os.environ.get("CUDA_HOME")
        if cuda_home and torch.version.cuda:
            nvcc = f"{cuda_home}/bin/nvcc"
            drop_cache_on_new_cuda_compiler(build_dir, nvcc)
            args += [
                f"-DCUDAToolkit_ROOT={cuda_home}",
                f"-DCUDA_TOOLKIT_ROOT_DIR={cuda_home}",
                f"-DCMAKE_CUDA_COMPILER={nvcc}",
            ]
        subprocess.check_call(["cmake", "-S", str(ROOT), "-B", str(build_dir), *args])
        build = ["cmake", "--build", str(build_dir)]
        if "MAX_JOBS" in os.environ:
            build += ["--parallel", os.environ["MAX_JOBS"]]
        subprocess.check_call(build)
        clear_installed(package_dir)
        subprocess.check_call(["cmake", "--install", str(build_dir)])
        if self.editable_mode:
            # Editable installs import from the source tree: put the libraries there too.
            clear_installed(ROOT / "forgetting_transformer")
            subprocess.check_call(["cmake", "--install", str(build_dir), "--prefix",
                                   str(ROOT / "forgetting_transformer")])


setup(
    ext_modules=[CMakeExtension("forgetting_transformer._C")],
    cmdclass={"build_ext": CMakeBuild},
)
