// The test runner's main. Before any test, the test process makes itself a child subreaper:
// a process of a daemon's tree that loses its parent (an orphaned sandbox process) is
// re-parented to the test, not to the machine's init, so the tests' process scans, which look
// only at the test's own descendants (tests/support/daemon_fixture.hpp), still see it.
#define CATCH_CONFIG_RUNNER
#include <catch2/catch.hpp>

#include <sys/prctl.h>

int main(int argc, char* argv[]) {
    ::prctl(PR_SET_CHILD_SUBREAPER, 1);
    return Catch::Session().run(argc, argv);
}
