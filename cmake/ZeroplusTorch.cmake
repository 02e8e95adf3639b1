# Finds torch and records its version and C++ ABI. Two modes:
#  * default: ask the Python interpreter (ZEROPLUS_PYTHON) and use torch's CMake package;
#  * ZEROPLUS_TORCH_DIR=<site-packages/torch>: read the unpacked wheel directly, without
#    importing it (used by scripts/cuda_build_check.sh, where a CUDA torch cannot be imported
#    on a machine without CUDA libraries). See cmake/ZeroplusTorchDir.cmake.
#
# The Python used is ZEROPLUS_PYTHON (cache) or the first python3 on PATH. Torch's CMake
# package is located with torch.utils.cmake_prefix_path so no CMAKE_PREFIX_PATH is needed.
set(ZEROPLUS_TORCH_DIR "" CACHE PATH "Unpacked torch package directory (skips the Python query)")
if(ZEROPLUS_TORCH_DIR)
  include(ZeroplusTorchDir)
  return()
endif()
set(ZEROPLUS_PYTHON "" CACHE FILEPATH "Python interpreter whose torch is built against")
# Under pip (scikit-build-core sets SKBUILD and Python_EXECUTABLE) the torch to build against is
# the one of the interpreter running pip, whatever an earlier configure of this directory chose.
if(DEFINED SKBUILD AND Python_EXECUTABLE)
  set(ZEROPLUS_PYTHON "${Python_EXECUTABLE}" CACHE FILEPATH "" FORCE)
elseif(NOT ZEROPLUS_PYTHON)
  find_program(ZEROPLUS_PYTHON_FOUND NAMES python3 python REQUIRED)
  set(ZEROPLUS_PYTHON "${ZEROPLUS_PYTHON_FOUND}" CACHE FILEPATH "" FORCE)
endif()

execute_process(
  COMMAND "${ZEROPLUS_PYTHON}" -c
    "import torch,os;print(torch.utils.cmake_prefix_path);print(torch.__version__);print(int(torch._C._GLIBCXX_USE_CXX11_ABI));print(os.path.dirname(torch.__file__));print(int(torch.version.cuda is not None))"
  OUTPUT_VARIABLE _torch_info OUTPUT_STRIP_TRAILING_WHITESPACE
  RESULT_VARIABLE _torch_rc)
if(NOT _torch_rc EQUAL 0)
  if(DEFINED SKBUILD)
    message(FATAL_ERROR "zeroplus: torch is not installed in the environment running pip (${ZEROPLUS_PYTHON}). "
                        "zeroplus is built against the torch it will run with: install torch>=2.11,<2.16 first "
                        "(pip install torch==2.13.0), then pip install --no-build-isolation .")
  endif()
  message(FATAL_ERROR "zeroplus: '${ZEROPLUS_PYTHON}' cannot import torch. Run scripts/setup.sh, "
                      "or pass -DZEROPLUS_PYTHON=<python with torch>, or -DZEROPLUS_WITH_TORCH=OFF.")
endif()
string(REPLACE "\n" ";" _torch_info "${_torch_info}")
list(GET _torch_info 0 _torch_prefix)
list(GET _torch_info 1 ZEROPLUS_TORCH_VERSION)
list(GET _torch_info 2 ZEROPLUS_TORCH_CXX11_ABI)
list(GET _torch_info 3 ZEROPLUS_TORCH_DIR)
list(GET _torch_info 4 _torch_has_cuda)

# ZEROPLUS_WITH_CUDA=AUTO compiles CUDA only when the torch in use was built with CUDA.
set(ZEROPLUS_CUDA_ENABLED OFF)
if(ZEROPLUS_WITH_CUDA STREQUAL "ON" OR (ZEROPLUS_WITH_CUDA STREQUAL "AUTO" AND _torch_has_cuda))
  if(NOT _torch_has_cuda)
    message(FATAL_ERROR "zeroplus: ZEROPLUS_WITH_CUDA=ON but torch ${ZEROPLUS_TORCH_VERSION} has no CUDA")
  endif()
  enable_language(CUDA)
  set(ZEROPLUS_CUDA_ENABLED ON)
endif()

# Torch_DIR is cached by find_package: pin it to this interpreter's torch, or a build directory
# reconfigured with another Python (pip in another venv) would keep the first torch.
set(Torch_DIR "${_torch_prefix}/Torch" CACHE PATH "" FORCE)
list(PREPEND CMAKE_PREFIX_PATH "${_torch_prefix}")
set(ZEROPLUS_TORCH_CMAKE_DIR "${_torch_prefix}/Torch")  # recorded in zeroplusConfig.cmake
# Torch's config warns about kineto and optional bits we do not use; keep configure quiet.
find_package(Torch REQUIRED QUIET)
string(REGEX MATCH "^([0-9]+)\\.([0-9]+)" _ "${ZEROPLUS_TORCH_VERSION}")
set(ZEROPLUS_TORCH_VERSION_MAJOR "${CMAKE_MATCH_1}")
set(ZEROPLUS_TORCH_VERSION_MINOR "${CMAKE_MATCH_2}")

# Every translation unit, torch-free ones included, must agree with torch on the std::string ABI.
add_compile_definitions(_GLIBCXX_USE_CXX11_ABI=${ZEROPLUS_TORCH_CXX11_ABI})
