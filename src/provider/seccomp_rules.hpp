#pragma once
/// @file seccomp_rules.hpp
/// The rules of the syscall filter (seccomp_filter.hpp): the one place that says what a
/// sandboxed command may not call, and why. Everything not named here is allowed. Plain data,
/// no libseccomp: seccomp_filter.cpp compiles it, the tests read it.
///
/// Sources: Docker's default profile (moby profiles/seccomp/default.json: what it denies to a
/// container without the capability that would unlock the call) and Flatpak's blocklist. Our
/// commands run without any capability, in user, PID, mount, IPC, UTS and cgroup namespaces
/// of their lease, so a call that only a capability unlocks fails anyway; it is listed when the
/// kernel code behind it is a known attack surface or when it is not namespaced, so that the
/// answer does not depend on capabilities staying dropped.
///
/// Left allowed on purpose:
/// - ptrace, process_vm_readv, process_vm_writev (Docker allows them since kernel 4.8, where
///   seccomp re-checks a traced syscall), and kcmp, pidfd_getfd, process_madvise (Docker ties
///   these to CAP_SYS_PTRACE): each passes the kernel's ptrace access check, so it reaches only
///   the lease's own processes of the same uid, which ptrace reaches anyway; debuggers and
///   strace are ordinary tools in a sandbox.
/// - name_to_handle_at: only makes a handle (Docker allows it); opening one is denied.
/// - sethostname, setdomainname: the UTS namespace is the lease's own. vhangup: needs
///   CAP_SYS_TTY_CONFIG of the host. modify_ldt: Docker allows it on x86 (Wine uses it).
/// - unshare and clone without namespace flags (threads, CLONE_FILES, CLONE_FS, CLONE_SYSVSEM):
///   ordinary programs use them; Docker's clone rule, too, tests the namespace flags only.

#include <sched.h>
#include <sys/ioctl.h>
#include <sys/personality.h>
#include <sys/socket.h>

#include <array>
#include <cstdint>
#include <string_view>

namespace sandboxd::detail::seccomp_rules {

/// What a denied call returns.
enum class action {
    eperm,   ///< -1 with EPERM: "not permitted", what a missing capability gives.
    enosys,  ///< -1 with ENOSYS: "no such call", for callers that fall back (clone3).
};

/// A syscall denied whatever its arguments.
struct syscall_rule {
    std::string_view name;
    action act;
    std::string_view why;
};

/// Reasons shared by several rules.
namespace why {
inline constexpr std::string_view keyrings =
    "kernel keyrings are not namespaced: one tenant's keys reach another's (Docker, Flatpak)";
inline constexpr std::string_view io_uring =
    "a large attack surface whose operations bypass this filter (Docker since v25)";
inline constexpr std::string_view modules = "loads or unloads code of the host kernel (Docker)";
inline constexpr std::string_view old_modules = "module call removed in 2.6 (Docker)";
inline constexpr std::string_view kexec = "replaces the running host kernel (Docker)";
inline constexpr std::string_view swap = "host swap is not namespaced (Docker)";
inline constexpr std::string_view set_clock =
    "the clock is the host's: time is not namespaced (Docker)";
inline constexpr std::string_view tune_clock =
    "tunes the host clock; Docker allows it for reading, which nothing here needs";
inline constexpr std::string_view quotas = "host disk quotas are not namespaced (Docker, Flatpak)";
inline constexpr std::string_view io_ports = "raw access to the host's I/O ports (Docker)";
inline constexpr std::string_view mounts =
    "the lease's mounts are set up before the command and fixed; mount code is a large attack "
    "surface, and unmounting could expose what a mount hides (Docker, Flatpak)";
inline constexpr std::string_view mount_api = "the new mount API: as mount (Docker, Flatpak)";
inline constexpr std::string_view numa =
    "NUMA placement: CVE history and no use in a lease, whose cgroup bounds its CPUs and memory "
    "(Docker without CAP_SYS_NICE, Flatpak)";
inline constexpr std::string_view vm86 =
    "16-bit virtual-8086 mode, a historic source of bugs (Docker)";
inline constexpr std::string_view user_namespace =
    "a user namespace needs no capability and grants all of them inside it (Docker, Flatpak)";
inline constexpr std::string_view other_namespaces =
    "other namespaces need CAP_SYS_ADMIN; denied whatever caps remain (Docker)";
}  // namespace why

inline constexpr syscall_rule plain_rules[] = {
    // Kernel facilities that are not namespaced, or that run code the caller provides.
    {"add_key", action::eperm, why::keyrings},
    {"keyctl", action::eperm, why::keyrings},
    {"request_key", action::eperm, why::keyrings},
    {"bpf", action::eperm,
     "eBPF verifier and maps: a large attack surface, long CVE history (Docker)"},
    {"perf_event_open", action::eperm,
     "profiling leaks host activity, many CVEs; profile from outside (Docker, Flatpak)"},
    {"userfaultfd", action::eperm,
     "stalls the kernel inside a page fault: the usual lever of race exploits (Docker)"},
    {"io_uring_setup", action::eperm, why::io_uring},
    {"io_uring_enter", action::eperm, why::io_uring},
    {"io_uring_register", action::eperm, why::io_uring},
    {"fanotify_init", action::eperm,
     "filesystem-wide monitoring, unprivileged since 5.13; needless here (Docker)"},
    {"syslog", action::eperm,
     "the kernel log is the host's: addresses, other tenants' messages (Docker, Flatpak)"},
    {"open_by_handle_at", action::eperm,
     "opens any inode by handle, past the mount namespace: the shocker breakout (Docker)"},
    // The host itself: modules, kexec, reboot, swap, clock, accounting, quotas, I/O ports.
    {"init_module", action::eperm, why::modules},
    {"finit_module", action::eperm, why::modules},
    {"delete_module", action::eperm, why::modules},
    {"create_module", action::eperm, why::old_modules},
    {"get_kernel_syms", action::eperm, why::old_modules},
    {"query_module", action::eperm, why::old_modules},
    {"kexec_load", action::eperm, why::kexec},
    {"kexec_file_load", action::eperm, why::kexec},
    {"reboot", action::eperm,
     "reboots the host, or ends the lease's PID namespace from inside (Docker)"},
    {"swapon", action::eperm, why::swap},
    {"swapoff", action::eperm, why::swap},
    {"settimeofday", action::eperm, why::set_clock},
    {"clock_settime", action::eperm, why::set_clock},
    {"stime", action::eperm, why::set_clock},
    {"clock_adjtime", action::eperm, why::tune_clock},
    {"adjtimex", action::eperm, why::tune_clock},
    {"acct", action::eperm, "host process accounting is not namespaced (Docker, Flatpak)"},
    {"quotactl", action::eperm, why::quotas},
    {"quotactl_fd", action::eperm, why::quotas},
    {"iopl", action::eperm, why::io_ports},
    {"ioperm", action::eperm, why::io_ports},
    // The lease's filesystem and namespaces are made before the command, which keeps them.
    {"mount", action::eperm, why::mounts},
    {"umount", action::eperm, why::mounts},
    {"umount2", action::eperm, why::mounts},
    {"fsopen", action::eperm, why::mount_api},
    {"fsconfig", action::eperm, why::mount_api},
    {"fsmount", action::eperm, why::mount_api},
    {"fspick", action::eperm, why::mount_api},
    {"open_tree", action::eperm, why::mount_api},
    {"move_mount", action::eperm, why::mount_api},
    {"mount_setattr", action::eperm, why::mount_api},
    {"pivot_root", action::eperm, why::mounts},
    {"chroot", action::eperm,
     "needs CAP_SYS_CHROOT, which commands lack: no answer changes (Flatpak)"},
    {"setns", action::eperm,
     "joining another namespace is never a command's business (Docker, Flatpak)"},
    {"clone3", action::enosys,
     "flags in memory seccomp cannot read; glibc falls back to clone (Docker, Flatpak)"},
    // Memory placement across NUMA nodes.
    {"mbind", action::eperm, why::numa},
    {"get_mempolicy", action::eperm, why::numa},
    {"set_mempolicy", action::eperm, why::numa},
    {"set_mempolicy_home_node", action::eperm, why::numa},
    {"move_pages", action::eperm, why::numa},
    {"migrate_pages", action::eperm, why::numa},
    // Obsolete or unimplemented: nothing needs them, old code lies behind some.
    {"lookup_dcookie", action::eperm,
     "oprofile leftover that maps cookies to kernel paths (Docker)"},
    {"nfsservctl", action::eperm, "removed in 3.1 (Docker)"},
    {"vm86", action::eperm, why::vm86},
    {"vm86old", action::eperm, why::vm86},
    {"uselib", action::eperm, "a.out library loading, obsolete (Docker, Flatpak)"},
    {"ustat", action::eperm, "obsolete, superseded by statfs (Docker)"},
    {"sysfs", action::eperm, "obsolete, superseded by /proc/filesystems (Docker)"},
    {"_sysctl", action::eperm, "binary sysctl, removed in 5.5 (Docker)"},
};

/// How an argument-filtered rule tests its argument.
enum class arg_test {
    any_bit,       ///< denied when the argument has any of the bits of `value` set
    low32_eq,      ///< denied when the argument's low 32 bits equal `value` (an int or a u32)
    persona_bits,  ///< personality(2): denied unless 0xffffffff (a query) or within `value`'s bits
};

/// A syscall denied for some values of one argument.
struct arg_rule {
    std::string_view name;
    action act;
    unsigned arg;  ///< index of the argument tested, from 0
    arg_test test;
    std::uint64_t value;
    std::string_view why;
};

/// The namespaces a command could make: all but user need CAP_SYS_ADMIN, which it lacks; a
/// user namespace needs nothing and hands the creator every capability inside it, which opens
/// mount, netfilter and the rest of the kernel's namespaced-root attack surface.
inline constexpr std::uint64_t capped_namespaces =
    CLONE_NEWNS | CLONE_NEWCGROUP | CLONE_NEWUTS | CLONE_NEWIPC | CLONE_NEWPID | CLONE_NEWNET;

/// clone's flags are its first argument except on s390, where the stack comes first.
#if defined(__s390__) || defined(__s390x__)
inline constexpr unsigned clone_flags_arg = 1;
#else
inline constexpr unsigned clone_flags_arg = 0;
#endif

/// What personality() may set, as in Docker's profile (0, 8, 0x20000, 0x20008 and the query
/// 0xffffffff): PER_LINUX, with or without PER_LINUX32 (32-bit uname) and UNAME26.
inline constexpr std::uint64_t allowed_persona_bits = std::uint64_t{PER_LINUX32} | UNAME26;

// CLONE_NEWTIME is tested for unshare only: in clone's flags its bit belongs to the exit signal.
inline constexpr arg_rule arg_rules[] = {
    {"clone", action::eperm, clone_flags_arg, arg_test::any_bit, CLONE_NEWUSER,
     why::user_namespace},
    {"clone", action::eperm, clone_flags_arg, arg_test::any_bit, capped_namespaces,
     why::other_namespaces},
    {"unshare", action::eperm, 0, arg_test::any_bit, CLONE_NEWUSER, why::user_namespace},
    {"unshare", action::eperm, 0, arg_test::any_bit, capped_namespaces | CLONE_NEWTIME,
     why::other_namespaces},
    {"personality", action::eperm, 0, arg_test::persona_bits, allowed_persona_bits,
     "other personalities change the address-space layout or exec rules, e.g. READ_IMPLIES_EXEC "
     "(Docker, Flatpak)"},
    {"ioctl", action::eperm, 1, arg_test::low32_eq, TIOCSTI,
     "pushes input into a terminal's queue: typing commands into the caller's shell "
     "(CVE-2017-5226, Flatpak)"},
    {"ioctl", action::eperm, 1, arg_test::low32_eq, TIOCLINUX,
     "console copy and paste, the same injection on a virtual console (CVE-2023-28100, Flatpak)"},
    {"socket", action::eperm, 0, arg_test::low32_eq, AF_VSOCK,
     "vsock reaches the hypervisor's host, outside the lease's network namespace (Docker)"},
};

/// Names of rules above that this architecture does not have (libseccomp knows them, the
/// kernel's syscall table here does not). Their rules are skipped; any other name that does
/// not resolve is an error, so that a typo cannot silently drop a rule.
#if defined(__x86_64__)
inline constexpr std::string_view absent_here[] = {"stime", "umount", "vm86", "vm86old"};
#elif defined(__aarch64__)
inline constexpr std::string_view absent_here[] = {
    "stime",  "umount", "vm86",  "vm86old", "create_module", "get_kernel_syms", "query_module",
    "uselib", "ustat",  "sysfs", "_sysctl", "iopl",          "ioperm"};
#else
// Another architecture: the filter refuses to build, naming the first rule to list here.
inline constexpr std::array<std::string_view, 0> absent_here{};
#endif

}  // namespace sandboxd::detail::seccomp_rules
