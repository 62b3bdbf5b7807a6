#pragma once
/// @file seccomp_filter.hpp
/// The syscall filter of every sandboxed process, built with libseccomp from the rules in
/// src/provider/seccomp_rules.hpp (one line per rule, with its reason). Internal to the
/// provider layer.
///
/// The filter allows everything that no rule names. Denials return an errno (EPERM, or
/// ENOSYS for clone3 as Docker's default profile does: glibc falls back to clone on ENOSYS
/// only), never a kill, so that programs fail clearly. Syscalls of any architecture other than
/// the native one (e.g. i386 through int 0x80 on x86_64, or x32) are refused with EPERM, so
/// that the rules cannot be bypassed through a compat table.
///
/// Building needs libseccomp (seccomp_filter.cpp); applying does not: apply_seccomp_filter()
/// is defined here, inline, so that the static sandboxd-init can apply a program it received
/// without linking libseccomp.
///
/// Thread-safety: build_seccomp_filter() is safe to call from any thread. It does not block.

#include <linux/filter.h>
#include <linux/seccomp.h>
#include <sys/prctl.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cerrno>
#include <cstddef>
#include <string>

namespace sandboxd::detail {

/// The compiled filter as a classic-BPF program: the bytes of `struct sock_filter[]`
/// (size a multiple of 8), ready for seccomp(SECCOMP_SET_MODE_FILTER, 0, &prog) after
/// prctl(PR_SET_NO_NEW_PRIVS, 1). Throws std::runtime_error naming the failing rule when
/// libseccomp refuses one (a bug, not a runtime condition).
std::string build_seccomp_filter();

/// Applies a program produced by build_seccomp_filter() to the calling thread with
/// SECCOMP_FILTER_FLAG_TSYNC unset (call it in a single-threaded process, e.g. a child before
/// exec). Sets no_new_privs first. Returns 0 or an errno value (EINVAL for a size that is not a
/// whole program of 1 to BPF_MAXINSNS instructions). Async-signal-safe (two syscalls), so it may
/// run between fork and exec.
inline int apply_seccomp_filter(const void* program, std::size_t size) noexcept {
    // sock_fprog.len is an unsigned short: refuse here what would otherwise be truncated.
    if (size == 0 || size % sizeof(sock_filter) != 0 || size / sizeof(sock_filter) > BPF_MAXINSNS)
        return EINVAL;
    // Without CAP_SYS_ADMIN the kernel accepts a filter only under no_new_privs, which also keeps
    // a set-uid program from running with privileges the filter was meant to bound.
    if (::prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0) return errno;
    sock_fprog prog{};
    prog.len = static_cast<unsigned short>(size / sizeof(sock_filter));
    // sock_fprog's pointer is not const, but the kernel only copies the program from it.
    prog.filter = static_cast<sock_filter*>(
        const_cast<void*>(program));  // NOLINT(cppcoreguidelines-pro-type-const-cast)
    if (::syscall(SYS_seccomp, SECCOMP_SET_MODE_FILTER, 0, &prog) != 0) return errno;
    return 0;
}

}  // namespace sandboxd::detail
