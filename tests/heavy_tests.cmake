# Included by ctest after the discovered Catch2 tests (tests/CMakeLists.txt): the lease race
# tests share the fault trials' RESOURCE_LOCK, so no two of these four run at once; their COST
# (seconds here, roughly) puts them first in the queue as the fault trials' does.
foreach(registry SqliteCluster EtcdCluster)
  set_tests_properties(
    "integration:Acquire and release pairs over two nodes never meet the sweeper - ${registry}"
    PROPERTIES RESOURCE_LOCK sandboxd_heavy COST 50)
endforeach()
# The send-budget test (issue 44, item 2) streams SANDBOXD_STALL_CHANNELS x SANDBOXD_STALL_BYTES
# through the daemon and measures another host's rate and the daemon's RSS: beside a heavy
# suite it would measure the machine.
set_tests_properties(
  "integration:A host that stops reading cannot grow the daemon: its output waits in the pipes, other hosts stream, and every byte arrives in order once it reads"
  PROPERTIES RESOURCE_LOCK sandboxd_heavy COST 170)
