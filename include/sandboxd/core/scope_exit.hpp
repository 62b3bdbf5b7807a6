#pragma once
// Runs a function when the scope ends, however it ends (return, exception, co_return, a
// coroutine destroyed while suspended). For releases that must happen exactly once: a turn
// given back, a reserved slot freed.
//
// The function must not throw: a destructor cannot report it, so an exception from it ends
// the process (std::terminate), as it would from any destructor, but here by intent.
// Not copyable or movable. Thread-safety: that of the function.
#include <exception>
#include <utility>

namespace sandboxd {

template <typename F>
class ScopeExit {
public:
    explicit ScopeExit(F f) : f_(std::move(f)) {}
    ScopeExit(const ScopeExit&) = delete;
    ScopeExit& operator=(const ScopeExit&) = delete;
    ~ScopeExit() {
        try {
            f_();
        } catch (...) {
            std::terminate();
        }
    }

private:
    F f_;
};

}  // namespace sandboxd
