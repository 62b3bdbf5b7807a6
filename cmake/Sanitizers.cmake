# sandboxd_enable_sanitizers(target): SANDBOXD_SANITIZERS is a list such as "address;undefined"
# (preset dev) or "thread" (preset tsan).
set(SANDBOXD_SANITIZERS "" CACHE STRING "Sanitizers to build with: address;undefined or thread")
function(sandboxd_enable_sanitizers target)
  if(SANDBOXD_SANITIZERS)
    list(JOIN SANDBOXD_SANITIZERS "," joined)
    target_compile_options(${target} INTERFACE -fsanitize=${joined} -fno-omit-frame-pointer
                                               -fno-sanitize-recover=undefined)
    target_link_options(${target} INTERFACE -fsanitize=${joined})
  endif()
endfunction()
