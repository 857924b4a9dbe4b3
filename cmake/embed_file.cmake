# cmake -DIN=file -DOUT=file.cc -DNAME=kSymbol -DNS=namespace -P embed_file.cmake
# Writes a C++ file defining `const char NAME[]` with the bytes of IN, for assets shipped inside
# a binary (no network fetch at run time).
file(READ "${IN}" content HEX)
string(LENGTH "${content}" hex_length)
math(EXPR size "${hex_length} / 2")
string(REGEX REPLACE "([0-9a-f][0-9a-f])" "'\\\\x\\1'," bytes "${content}")
file(WRITE "${OUT}" "// Generated from ${IN} by cmake/embed_file.cmake; do not edit.\n#include <cstddef>\nnamespace ${NS} {\nextern const char ${NAME}[] = {${bytes} 0};\nextern const std::size_t ${NAME}Size = ${size};\n}  // namespace ${NS}\n")
