# Warnings for every target of the project, and the floating-point contract the reference
# kernels need: no contraction of a*b+c into FMA behind our back (docs/math.md fixes where each
# rounding happens; optimized kernels use FMA explicitly through intrinsics).
# (C/C++ only: nvcc gets its own flags, --fmad=false on the kernels, in services/CMakeLists.txt.)
add_compile_options("$<$<COMPILE_LANGUAGE:C,CXX>:-Wall;-Wextra;-Wno-unused-parameter>")
if(CMAKE_CXX_COMPILER_ID MATCHES "GNU|Clang")
  add_compile_options("$<$<COMPILE_LANGUAGE:C,CXX>:-ffp-contract=off;-fno-fast-math>")
endif()
option(MOE_WERROR "Treat warnings as errors" OFF)
if(MOE_WERROR)
  add_compile_options("$<$<COMPILE_LANGUAGE:C,CXX>:-Werror>")
endif()
