# The allocator of every binary (services/common/allocator.h says why): gperftools' tcmalloc
# (Debian libgoogle-perftools-dev) unless -DMOE_ALLOCATOR=system. Sanitizers bring their own
# allocator, so a build with -fsanitize in its flags keeps glibc's.
if(CMAKE_CXX_FLAGS MATCHES "-fsanitize" OR MOE_BUILD_FUZZERS)
  set(_moe_allocator_default system)
else()
  set(_moe_allocator_default tcmalloc)
endif()
set(MOE_ALLOCATOR ${_moe_allocator_default} CACHE STRING "malloc of every binary: tcmalloc or system")
set_property(CACHE MOE_ALLOCATOR PROPERTY STRINGS tcmalloc system)

if(MOE_ALLOCATOR STREQUAL "tcmalloc")
  find_library(MOE_TCMALLOC NAMES tcmalloc_minimal)
  if(NOT MOE_TCMALLOC)
    message(FATAL_ERROR "MOE_ALLOCATOR=tcmalloc: libtcmalloc_minimal not found (Debian "
                        "libgoogle-perftools-dev; scripts/setup.sh installs it), or configure "
                        "with -DMOE_ALLOCATOR=system")
  endif()
  # Nothing calls tcmalloc by name (it replaces malloc), so a linker that drops unreferenced
  # libraries (--as-needed) must be told to keep it.
  set(CMAKE_LINK_LIBRARY_USING_MOE_NO_AS_NEEDED
      "LINKER:--push-state,--no-as-needed" "<LINK_ITEM>" "LINKER:--pop-state")
  set(CMAKE_LINK_LIBRARY_USING_MOE_NO_AS_NEEDED_SUPPORTED TRUE)
elseif(NOT MOE_ALLOCATOR STREQUAL "system")
  message(FATAL_ERROR "MOE_ALLOCATOR is '${MOE_ALLOCATOR}'; it takes tcmalloc or system")
endif()

# moe_allocator: link it to an executable (moe_svc_main and every test do) and it runs on the
# chosen allocator; AllocatorName() says which one serves malloc.
add_library(moe_allocator services/common/allocator.cc)
target_include_directories(moe_allocator PUBLIC ${PROJECT_SOURCE_DIR})
target_link_libraries(moe_allocator PUBLIC ${CMAKE_DL_LIBS})
if(MOE_ALLOCATOR STREQUAL "tcmalloc")
  target_link_libraries(moe_allocator PUBLIC "$<LINK_LIBRARY:MOE_NO_AS_NEEDED,${MOE_TCMALLOC}>")
endif()
