# sandboxd_enable_hardening(target): _FORTIFY_SOURCE, libstdc++ assertions, stack protector,
# PIE, full RELRO and non-executable stack. On in every preset; FORTIFY needs optimisation.
option(SANDBOXD_HARDENING "Build with hardening flags" ON)
set(CMAKE_POSITION_INDEPENDENT_CODE ON)
function(sandboxd_enable_hardening target)
  if(SANDBOXD_HARDENING)
    target_compile_definitions(${target} INTERFACE _GLIBCXX_ASSERTIONS
                               $<$<NOT:$<CONFIG:Debug>>:_FORTIFY_SOURCE=2>)
    target_compile_options(${target} INTERFACE -fstack-protector-strong -fstack-clash-protection
                                               -fcf-protection)
    target_link_options(${target} INTERFACE -pie -Wl,-z,relro -Wl,-z,now -Wl,-z,noexecstack)
  endif()
endfunction()
