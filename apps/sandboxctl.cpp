// sandboxctl: the command-line client. Everything lives in the core library.
#include <sandboxd/app/app.hpp>

int main(int argc, char** argv) { return sandboxd::ctl_main(argc, argv); }
