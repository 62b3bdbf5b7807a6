# Included by ctest after the discovered Catch2 tests (tests/CMakeLists.txt): the lease race
# tests share the fault trials' RESOURCE_LOCK, so no two of these four run at once; their COST
# (seconds here, roughly) puts them first in the queue as the fault trials' does.
foreach(registry SqliteCluster EtcdCluster)
  set_tests_properties(
    "integration:Acquire and release pairs over two nodes never meet the sweeper - ${registry}"
    PROPERTIES RESOURCE_LOCK sandboxd_heavy COST 50)
endforeach()
