# cmake -DINPUT=file -DOUTPUT=header.h -DNAME=kSymbol -P embed_file.cmake: writes a header holding the
# bytes of INPUT as `inline constexpr char NAME[]` (NUL-terminated), so a file ships inside the binary.
file(READ "${INPUT}" hex HEX)
string(REGEX REPLACE "([0-9a-f][0-9a-f])" "'\\\\x\\1'," bytes "${hex}")
string(REGEX REPLACE "(('\\\\x[0-9a-f][0-9a-f]',){24})" "\\1\n" bytes "${bytes}")
file(WRITE "${OUTPUT}.tmp" "// Generated from ${INPUT} by cmake/embed_file.cmake; do not edit.\n#pragma once\ninline constexpr char ${NAME}[] = {\n${bytes}'\\0'};\n")
file(COPY_FILE "${OUTPUT}.tmp" "${OUTPUT}" ONLY_IF_DIFFERENT)
file(REMOVE "${OUTPUT}.tmp")
