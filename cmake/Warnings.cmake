# sandboxd_set_warnings(target): the project's warning set, as errors in the dev preset.
option(SANDBOXD_WARNINGS_AS_ERRORS "Treat compiler warnings as errors" OFF)
function(sandboxd_set_warnings target)
  get_target_property(type ${target} TYPE)
  if(type STREQUAL "INTERFACE_LIBRARY")
    set(scope INTERFACE)
  else()
    set(scope PRIVATE)
  endif()
  set(flags -Wall -Wextra -Wpedantic -Wshadow -Wnon-virtual-dtor -Wcast-align -Wunused
            -Woverloaded-virtual -Wnull-dereference -Wformat=2 -Wimplicit-fallthrough
            # GCC 12 reports false positives inside Boost.Beast and Boost.Optional.
            -Wno-maybe-uninitialized)
  if(SANDBOXD_WARNINGS_AS_ERRORS)
    list(APPEND flags -Werror)
  endif()
  target_compile_options(${target} ${scope} ${flags})
endfunction()
