# Post-link check (cmake -P): LIBRARY must not define libstdc++'s own symbols (a static copy of
# the C++ runtime inside a torch plugin; see zeroplus_link_shared_cxx_runtime). std::locale::classic
# is defined by every copy of libstdc++ and by nothing else.
execute_process(COMMAND "${NM}" -D --defined-only "${LIBRARY}" OUTPUT_VARIABLE symbols RESULT_VARIABLE rc)
if(NOT rc EQUAL 0)
  message(FATAL_ERROR "zeroplus: ${NM} could not read ${LIBRARY}")
endif()
if(symbols MATCHES "_ZNSt6locale7classicEv")
  file(REMOVE "${LIBRARY}")
  message(FATAL_ERROR "zeroplus: ${LIBRARY} contains its own copy of libstdc++ (it defines std::locale::classic); "
                      "it would crash inside torch's process. Removed it. Link against the shared libstdc++.")
endif()
