# sandboxd_enable_sanitizers(target): SANDBOXD_SANITIZERS is a list such as "address;undefined"
# (preset dev) or "thread" (preset tsan).
set(SANDBOXD_SANITIZERS "" CACHE STRING "Sanitizers to build with: address;undefined or thread")
function(sandboxd_enable_sanitizers target)
  if(SANDBOXD_SANITIZERS)
    list(JOIN SANDBOXD_SANITIZERS "," joined)
    target_compile_options(${target} INTERFACE -fsanitize=${joined} -fno-omit-frame-pointer
                                               -fno-sanitize-recover=undefined)
    target_link_options(${target} INTERFACE -fsanitize=${joined})
    if("undefined" IN_LIST SANDBOXD_SANITIZERS)
      # UBSan's vptr check probes memory through a pipe(); with no descriptor left (EMFILE, a
      # case the tests provoke on purpose) the probe fails and the check reports every
      # polymorphic access as invalid and aborts. ASan still catches bad object accesses.
      target_compile_options(${target} INTERFACE -fno-sanitize=vptr)
      target_link_options(${target} INTERFACE -fno-sanitize=vptr)
    endif()
  endif()
endfunction()
