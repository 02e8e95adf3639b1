# Compiler launcher, threads and system libraries shared by all components.
set(ZEROPLUS_CCACHE_PROGRAM "off")
if(ZEROPLUS_USE_CCACHE)
  find_program(_ccache ccache)
  if(_ccache)
    set(CMAKE_C_COMPILER_LAUNCHER "${_ccache}")
    set(CMAKE_CXX_COMPILER_LAUNCHER "${_ccache}")
    set(CMAKE_CUDA_COMPILER_LAUNCHER "${_ccache}")
    set(ZEROPLUS_CCACHE_PROGRAM "${_ccache}")
  endif()
endif()

set(THREADS_PREFER_PTHREAD_FLAG ON)
find_package(Threads REQUIRED)

# liburing: pkg-config first; without pkg-config (minimal images, e.g. a GPU machine's) the
# header and library are looked up directly (CMAKE_PREFIX_PATH / LIBURING_ROOT).
find_package(PkgConfig QUIET)
if(PKG_CONFIG_FOUND)
  pkg_check_modules(LIBURING IMPORTED_TARGET liburing)
endif()
if(NOT LIBURING_FOUND)
  find_path(ZEROPLUS_LIBURING_INCLUDE_DIR liburing.h HINTS "$ENV{LIBURING_ROOT}/include")
  find_library(ZEROPLUS_LIBURING_LIBRARY uring HINTS "$ENV{LIBURING_ROOT}/lib")
  if(ZEROPLUS_LIBURING_INCLUDE_DIR AND ZEROPLUS_LIBURING_LIBRARY)
    add_library(PkgConfig::LIBURING INTERFACE IMPORTED)
    target_include_directories(PkgConfig::LIBURING INTERFACE "${ZEROPLUS_LIBURING_INCLUDE_DIR}")
    target_link_libraries(PkgConfig::LIBURING INTERFACE "${ZEROPLUS_LIBURING_LIBRARY}")
    set(LIBURING_FOUND 1)
    set(LIBURING_VERSION "found without pkg-config")
  endif()
endif()
if(LIBURING_FOUND)
  set(ZEROPLUS_LIBURING_FOUND "yes (${LIBURING_VERSION})")
else()
  set(ZEROPLUS_LIBURING_FOUND "no")
endif()

# libzeroplus.so must use the process's shared libstdc++, never a copy of its own: torch is
# linked against the shared one, and a second, static copy inside the plugin mixes the two
# copies' locale and iostream state (seen on a GPU image whose g++ adds -static-libstdc++: a
# segfault in std::ostream::operator<< while a 2-rank group was being created). The toolchain's
# shared libstdc++ and libgcc_s are named on the link line, so whatever static archives the
# compiler driver appends afterwards contribute nothing; a check after linking makes sure.
function(zeroplus_link_shared_cxx_runtime target)
  if(NOT CMAKE_CXX_COMPILER_ID MATCHES "GNU|Clang")
    return()
  endif()
  foreach(lib libstdc++.so libgcc_s.so)
    execute_process(COMMAND "${CMAKE_CXX_COMPILER}" -print-file-name=${lib}
                    OUTPUT_VARIABLE path OUTPUT_STRIP_TRAILING_WHITESPACE ERROR_QUIET)
    if(NOT (IS_ABSOLUTE "${path}" AND EXISTS "${path}"))
      # A toolchain without shared runtimes of its own (a GPU image's /opt/gcc has only the
      # static archives): the system's, which torch's libraries load anyway.
      string(REGEX REPLACE "\\.so$" "" _name "${lib}")
      string(MAKE_C_IDENTIFIER "ZEROPLUS_SYSTEM_${_name}" _var)
      find_library(${_var} NAMES ${lib}.6 ${lib}.1 ${lib} PATHS /usr/lib/x86_64-linux-gnu /usr/lib64 /usr/lib
                   /lib/x86_64-linux-gnu NO_DEFAULT_PATH)
      set(path "${${_var}}")
    endif()
    if(IS_ABSOLUTE "${path}" AND EXISTS "${path}")
      target_link_libraries(${target} PRIVATE "${path}")
    elseif(lib STREQUAL "libstdc++.so")
      message(FATAL_ERROR "zeroplus: no shared libstdc++ found (${CMAKE_CXX_COMPILER} -print-file-name=libstdc++.so "
                          "and the system library directories); a plugin with a static copy crashes inside torch. "
                          "Use a compiler with a shared libstdc++ (e.g. CXX=/usr/bin/g++).")
    endif()
  endforeach()
  add_custom_command(TARGET ${target} POST_BUILD
    COMMAND "${CMAKE_COMMAND}" -DLIBRARY=$<TARGET_FILE:${target}> -DNM=${CMAKE_NM}
            -P "${PROJECT_SOURCE_DIR}/cmake/ZeroplusCheckSharedRuntime.cmake"
    VERBATIM)
endfunction()
