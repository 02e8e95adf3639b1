# Small helpers shared by every component's CMakeLists.txt.

# Torch adapter sources from all components are compiled into the single shared library
# (one target, one precompiled header): components append to a global property.
function(zeroplus_add_torch_sources)
  foreach(src IN LISTS ARGN)
    get_filename_component(abs "${src}" ABSOLUTE BASE_DIR "${CMAKE_CURRENT_SOURCE_DIR}")
    set_property(GLOBAL APPEND PROPERTY ZEROPLUS_TORCH_SOURCES "${abs}")
  endforeach()
endfunction()

# A torch-free component library: static, PIC, warnings on, its folder is the include root
# (so headers are included as "process_group/core/x.hpp" from the repository root).
function(zeroplus_add_core_library name)
  add_library(${name} STATIC ${ARGN})
  target_include_directories(${name} PUBLIC "${PROJECT_SOURCE_DIR}")
  zeroplus_set_warnings(${name})
  set_property(GLOBAL APPEND PROPERTY ZEROPLUS_CORE_LIBRARIES ${name})
endfunction()

function(zeroplus_set_warnings target)
  target_compile_options(${target} PRIVATE -Wall -Wextra -Wno-unused-parameter)
  if(ZEROPLUS_WERROR)
    target_compile_options(${target} PRIVATE -Werror)
  endif()
endfunction()

# One GoogleTest executable per test file, registered with ctest under the file's name.
# Usage: zeroplus_add_gtest(aio_engine_test.cpp LIBS zeroplus_aio_core [LABELS aio] [TIMEOUT 120])
function(zeroplus_add_gtest file)
  cmake_parse_arguments(ARG "" "TIMEOUT" "LIBS;LABELS" ${ARGN})
  get_filename_component(name "${file}" NAME_WE)
  add_executable(${name} "${file}")
  target_link_libraries(${name} PRIVATE ${ARG_LIBS} GTest::gtest GTest::gtest_main Threads::Threads)
  zeroplus_set_warnings(${name})
  if(NOT ARG_TIMEOUT)
    set(ARG_TIMEOUT 300)
  endif()
  # Sanitized binaries run 2-15x slower (TSan most): scale the budget, keep the hang guard.
  if(ZEROPLUS_SANITIZE MATCHES "thread")
    math(EXPR ARG_TIMEOUT "${ARG_TIMEOUT} * 5")
  elseif(ZEROPLUS_SANITIZE)
    math(EXPR ARG_TIMEOUT "${ARG_TIMEOUT} * 3")
  endif()
  add_test(NAME ${name} COMMAND ${name})
  set_tests_properties(${name} PROPERTIES TIMEOUT ${ARG_TIMEOUT} LABELS "${ARG_LABELS}")
endfunction()

# The torch versions whose headers the sources compile against (DESIGN.md §5). Outside them the
# build stops here with one line, instead of hundreds of compiler errors later.
set(ZEROPLUS_TORCH_SUPPORTED_MIN "2.11")
set(ZEROPLUS_TORCH_SUPPORTED_MAX "2.15")
function(zeroplus_check_torch_version version)
  string(REGEX MATCH "^[0-9]+\\.[0-9]+" _minor "${version}")
  if(NOT _minor OR _minor VERSION_LESS ZEROPLUS_TORCH_SUPPORTED_MIN OR _minor VERSION_GREATER ZEROPLUS_TORCH_SUPPORTED_MAX)
    message(FATAL_ERROR "zeroplus: torch ${version} is not supported; zeroplus builds against torch "
                        "${ZEROPLUS_TORCH_SUPPORTED_MIN} to ${ZEROPLUS_TORCH_SUPPORTED_MAX} "
                        "(pip install 'torch>=${ZEROPLUS_TORCH_SUPPORTED_MIN},<2.16')")
  endif()
endfunction()

function(zeroplus_print_summary)
  get_property(cores GLOBAL PROPERTY ZEROPLUS_CORE_LIBRARIES)
  get_property(torch_srcs GLOBAL PROPERTY ZEROPLUS_TORCH_SOURCES)
  list(LENGTH torch_srcs n_torch)
  message(STATUS "")
  message(STATUS "zeroplus ${PROJECT_VERSION} configuration")
  message(STATUS "  build type          : ${CMAKE_BUILD_TYPE}")
  message(STATUS "  compiler            : ${CMAKE_CXX_COMPILER_ID} ${CMAKE_CXX_COMPILER_VERSION} (C++${CMAKE_CXX_STANDARD})")
  message(STATUS "  ccache              : ${ZEROPLUS_CCACHE_PROGRAM}")
  message(STATUS "  ZEROPLUS_WITH_TORCH : ${ZEROPLUS_WITH_TORCH}")
  if(ZEROPLUS_WITH_TORCH)
    message(STATUS "  torch               : ${ZEROPLUS_TORCH_VERSION} (${ZEROPLUS_TORCH_DIR})")
    message(STATUS "  CXX11 ABI           : ${ZEROPLUS_TORCH_CXX11_ABI}")
    message(STATUS "  CUDA sources        : ${ZEROPLUS_CUDA_ENABLED} (ZEROPLUS_WITH_CUDA=${ZEROPLUS_WITH_CUDA})")
    message(STATUS "  precompiled headers : ${ZEROPLUS_USE_PCH}")
    message(STATUS "  torch adapter TUs   : ${n_torch}")
  endif()
  message(STATUS "  liburing            : ${ZEROPLUS_LIBURING_FOUND}")
  if(ZEROPLUS_SANITIZE OR ZEROPLUS_BUILD_FUZZERS)
    message(STATUS "  sanitizers          : ${ZEROPLUS_SANITIZE}")
    message(STATUS "  fuzz targets        : ${ZEROPLUS_BUILD_FUZZERS}")
  endif()
  message(STATUS "  core libraries      : ${cores}")
  message(STATUS "  tests               : ${ZEROPLUS_BUILD_TESTS}")
  message(STATUS "")
endfunction()
