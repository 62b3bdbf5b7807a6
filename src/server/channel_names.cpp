// The names of channel outcomes and signals on the wire (channel.hpp). No coroutines: the fuzz
// target tests/fuzz/fuzz_jsonrpc.cpp builds this file with methods.cpp.
#include "server/channel.hpp"

#include <csignal>

namespace sandboxd {
namespace {

struct SignalName {
    int number;
    const char* name;
};
constexpr SignalName signal_names[] = {
    {SIGHUP, "HUP"},       {SIGINT, "INT"},   {SIGQUIT, "QUIT"},   {SIGILL, "ILL"},
    {SIGTRAP, "TRAP"},     {SIGABRT, "ABRT"}, {SIGBUS, "BUS"},     {SIGFPE, "FPE"},
    {SIGKILL, "KILL"},     {SIGUSR1, "USR1"}, {SIGSEGV, "SEGV"},   {SIGUSR2, "USR2"},
    {SIGPIPE, "PIPE"},     {SIGALRM, "ALRM"}, {SIGTERM, "TERM"},   {SIGCHLD, "CHLD"},
    {SIGCONT, "CONT"},     {SIGSTOP, "STOP"}, {SIGTSTP, "TSTP"},   {SIGTTIN, "TTIN"},
    {SIGTTOU, "TTOU"},     {SIGURG, "URG"},   {SIGXCPU, "XCPU"},   {SIGXFSZ, "XFSZ"},
    {SIGVTALRM, "VTALRM"}, {SIGPROF, "PROF"}, {SIGWINCH, "WINCH"}, {SIGIO, "IO"},
    {SIGPWR, "PWR"},       {SIGSYS, "SYS"},
};

}  // namespace

std::string_view to_string(channel_outcome o) noexcept {
    switch (o) {
        case channel_outcome::exited: return "exited";
        case channel_outcome::signaled: return "signaled";
        case channel_outcome::timed_out: return "timedOut";
        case channel_outcome::stopped: return "stopped";
        case channel_outcome::lease_released: return "leaseReleased";
        case channel_outcome::transport_closed: return "transportClosed";
        case channel_outcome::error: return "error";
    }
    return "error";
}

std::string signal_name(int sig) {
    for (const auto& s : signal_names) {
        if (s.number == sig) return s.name;
    }
    return "SIG" + std::to_string(sig);
}

int parse_signal_name(std::string_view name) noexcept {
    static constexpr std::string_view allowed[] = {"INT",  "TERM", "HUP",  "QUIT",
                                                   "KILL", "USR1", "USR2", "WINCH"};
    for (auto a : allowed) {
        if (a != name) continue;
        for (const auto& s : signal_names) {
            if (name == s.name) return s.number;
        }
    }
    return 0;
}

}  // namespace sandboxd
