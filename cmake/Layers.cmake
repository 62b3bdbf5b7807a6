# One static library per layer (docs/architecture.md), with include roots that let a layer see
# only what it may: its own public headers (include/sandboxd/<layer>) and private headers
# (src/<layer>, included as "<layer>/x.hpp"), plus the public headers of the layers it links
# PUBLIC. The roots are directories of symbolic links in the build tree, because the real
# include/ and src/ would expose every layer at once: a lower layer that includes a higher
# layer's header then fails to compile ("No such file or directory"), which the
# "layers:" tests of tests/CMakeLists.txt check.
#
#   sandboxd_add_layer(<layer> SOURCES <src>... [PRIVATE_DIRS <dir under src/>...]
#                      [PUBLIC_LIBS <target>...] [PRIVATE_LIBS <target>...])
# Defines the target sandboxd_<layer>. PRIVATE_DIRS defaults to <layer>.
function(sandboxd_add_layer layer)
  cmake_parse_arguments(PARSE_ARGV 1 arg "" "" "SOURCES;PRIVATE_DIRS;PUBLIC_LIBS;PRIVATE_LIBS")
  if(NOT arg_PRIVATE_DIRS)
    set(arg_PRIVATE_DIRS ${layer})
  endif()
  set(root ${PROJECT_BINARY_DIR}/layers/${layer})
  file(MAKE_DIRECTORY ${root}/public/sandboxd ${root}/private)
  file(CREATE_LINK ${PROJECT_SOURCE_DIR}/include/sandboxd/${layer}
       ${root}/public/sandboxd/${layer} SYMBOLIC)
  foreach(dir IN LISTS arg_PRIVATE_DIRS)
    file(CREATE_LINK ${PROJECT_SOURCE_DIR}/src/${dir} ${root}/private/${dir} SYMBOLIC)
  endforeach()

  set(target sandboxd_${layer})
  add_library(${target} STATIC ${arg_SOURCES})
  target_include_directories(${target} PUBLIC ${root}/public PRIVATE ${root}/private)
  target_link_libraries(${target}
    PUBLIC ${arg_PUBLIC_LIBS} PRIVATE sandboxd_options ${arg_PRIVATE_LIBS})
  # Parsing Asio, Beast, nlohmann and spdlog once costs minutes on 2 cores: every layer reuses
  # the core's precompiled header (same compiler flags: they all come from sandboxd_options and
  # the core's PUBLIC definitions).
  if(NOT layer STREQUAL "core")
    target_precompile_headers(${target} REUSE_FROM sandboxd_core)
  endif()
  set_property(GLOBAL APPEND PROPERTY SANDBOXD_LAYERS ${layer})
endfunction()
