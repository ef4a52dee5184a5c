# ctest cli_install: `cmake --install BUILD_DIR --prefix PREFIX`, then PREFIX/bin/k3 without -m and
# without $K3_MODEL runs the installed copy of the bundled model (PREFIX/share/k3/models/k3-nano).
file(REMOVE_RECURSE ${PREFIX})
execute_process(COMMAND ${CMAKE_COMMAND} --install ${BUILD_DIR} --prefix ${PREFIX} RESULT_VARIABLE rc OUTPUT_QUIET)
if(NOT rc EQUAL 0)
  message(FATAL_ERROR "cmake --install failed (${rc})")
endif()
foreach(f bin/k3 share/k3/models/k3-nano/config.json share/k3/models/k3-nano/tiktoken.model
          share/k3/models/k3-nano/model.safetensors.index.json)
  if(NOT EXISTS ${PREFIX}/${f})
    message(FATAL_ERROR "cmake --install did not install ${f}")
  endif()
endforeach()
execute_process(COMMAND env -u K3_MODEL ${PREFIX}/bin/k3 run -n 2 --seed 1 hi RESULT_VARIABLE rc
                OUTPUT_VARIABLE out ERROR_VARIABLE err)
if(NOT rc EQUAL 0)
  message(FATAL_ERROR "installed k3 run failed (${rc}): ${err}")
endif()
if(NOT err MATCHES "loaded [^\n]*share/k3/models/k3-nano")
  message(FATAL_ERROR "installed k3 did not use the installed model: ${err}")
endif()
file(REMOVE_RECURSE ${PREFIX})
