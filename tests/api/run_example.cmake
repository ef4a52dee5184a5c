# Runs the example (examples/generate.cpp) for a few tokens: it must exit 0 and print each of its
# three prompts followed by generated text. Usage: cmake -DEXE=... -DMODEL=... -P run_example.cmake
execute_process(COMMAND ${EXE} ${MODEL} 6 RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err)
message("${out}")
if(NOT rc EQUAL 0)
  message(FATAL_ERROR "k3_example_generate exited with ${rc}: ${err}")
endif()
foreach(want "\\[0\\] The function returns[^\n]" "\\[1\\] To install the package,[^\n]" "\\[2\\] A database index[^\n]")
  if(NOT out MATCHES "${want}")
    message(FATAL_ERROR "output lacks a line matching '${want}'")
  endif()
endforeach()
