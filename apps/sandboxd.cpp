// sandboxd: the daemon executable. Everything lives in the core library.
#include <sandboxd/app/app.hpp>

int main(int argc, char** argv) { return sandboxd::daemon_main(argc, argv); }
