# Included before find_package(Torch) by our CMakeLists.txt and by the installed fox_torchConfig.cmake.
# A CUDA-enabled LibTorch looks for its toolkit three ways (FindCUDA: CUDA_TOOLKIT_ROOT_DIR, the
# CUDA language: CMAKE_CUDA_COMPILER, FindCUDAToolkit: CUDAToolkit_ROOT) and, where nvcc on PATH is
# not part of a full toolkit (a toolkit assembled from the CUDA wheels), needs all three. Derive
# each one that is not set from a single root: CUDA_HOME, as -DCUDA_HOME=... or in the environment.
set(_fox_cuda_home "${CUDA_HOME}")
if(NOT _fox_cuda_home AND DEFINED ENV{CUDA_HOME})
  set(_fox_cuda_home "$ENV{CUDA_HOME}")
endif()
if(_fox_cuda_home AND EXISTS "${_fox_cuda_home}/bin/nvcc")
  if(NOT CUDA_TOOLKIT_ROOT_DIR)
    set(CUDA_TOOLKIT_ROOT_DIR "${_fox_cuda_home}" CACHE PATH "CUDA toolkit root (from CUDA_HOME)")
  endif()
  if(NOT CUDAToolkit_ROOT AND NOT DEFINED ENV{CUDAToolkit_ROOT})
    set(CUDAToolkit_ROOT "${_fox_cuda_home}")
  endif()
  # Only before the CUDA language is enabled: CMake cannot switch compilers in a configured tree.
  if(NOT CMAKE_CUDA_COMPILER AND NOT DEFINED ENV{CUDACXX})
    set(CMAKE_CUDA_COMPILER "${_fox_cuda_home}/bin/nvcc" CACHE FILEPATH "CUDA compiler (from CUDA_HOME)")
  endif()
endif()
unset(_fox_cuda_home)
