# Sanitizer and fuzzer builds of the torch-free cores (scripts/sanitizers.sh, scripts/fuzz.sh).
#
# ZEROPLUS_SANITIZE is a comma list handed to -fsanitize= for every target of the tree:
# "address,undefined" (ASan+UBSan) or "thread" (TSan). Torch and its Python are not built with
# a sanitizer runtime, so these builds need ZEROPLUS_WITH_TORCH=OFF: the cores and their
# GoogleTests only. Undefined behaviour aborts (-fno-sanitize-recover) so that ctest sees it.
#
# ZEROPLUS_BUILD_FUZZERS adds the libFuzzer targets of tests/fuzz; it needs clang (libFuzzer
# ships with clang, not GCC) and instruments the cores with -fsanitize=fuzzer-no-link.
set(ZEROPLUS_SANITIZE "" CACHE STRING "Build with -fsanitize=<list> (address,undefined or thread); torch-free cores only")
option(ZEROPLUS_BUILD_FUZZERS "Build the libFuzzer targets of tests/fuzz (clang; torch-free cores only)" OFF)

if(ZEROPLUS_BUILD_FUZZERS AND NOT ZEROPLUS_SANITIZE)
  set(ZEROPLUS_SANITIZE "address,undefined")
endif()

if(ZEROPLUS_SANITIZE)
  if(ZEROPLUS_WITH_TORCH)
    message(FATAL_ERROR "zeroplus: ZEROPLUS_SANITIZE=${ZEROPLUS_SANITIZE} builds the torch-free cores only; "
                        "configure with -DZEROPLUS_WITH_TORCH=OFF")
  endif()
  if(ZEROPLUS_SANITIZE MATCHES "thread" AND ZEROPLUS_SANITIZE MATCHES "address")
    message(FATAL_ERROR "zeroplus: ThreadSanitizer cannot be combined with AddressSanitizer")
  endif()
  set(_zp_san_flags "-fsanitize=${ZEROPLUS_SANITIZE}" -fno-omit-frame-pointer -fno-sanitize-recover=all)
  add_compile_options(${_zp_san_flags})
  add_link_options(${_zp_san_flags})
endif()

if(ZEROPLUS_BUILD_FUZZERS)
  if(NOT CMAKE_CXX_COMPILER_ID STREQUAL "Clang")
    message(FATAL_ERROR "zeroplus: ZEROPLUS_BUILD_FUZZERS needs clang (libFuzzer): "
                        "configure with CC=clang CXX=clang++ (Debian: apt-get install clang libclang-rt-14-dev)")
  endif()
  if(ZEROPLUS_WITH_TORCH)
    message(FATAL_ERROR "zeroplus: ZEROPLUS_BUILD_FUZZERS builds the torch-free cores only; "
                        "configure with -DZEROPLUS_WITH_TORCH=OFF")
  endif()
  # Coverage instrumentation for everything; the fuzz targets add -fsanitize=fuzzer (main()).
  add_compile_options(-fsanitize=fuzzer-no-link)
endif()
