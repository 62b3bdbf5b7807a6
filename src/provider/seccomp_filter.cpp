/// @file seccomp_filter.cpp
/// Compiles the rules of seccomp_rules.hpp into a classic-BPF program with libseccomp.

#include "provider/seccomp_filter.hpp"

#include "provider/seccomp_rules.hpp"

#include <sandboxd/core/unique_fd.hpp>

#include <seccomp.h>
#include <sys/mman.h>
#include <sys/stat.h>

#include <algorithm>
#include <cstring>
#include <memory>
#include <stdexcept>
#include <system_error>
#include <vector>

namespace sandboxd::detail {
namespace {

namespace rules = seccomp_rules;

struct release_filter {
    void operator()(void* ctx) const noexcept { seccomp_release(ctx); }
};
using filter_ctx = std::unique_ptr<void, release_filter>;

/// Throws for libseccomp's negative-errno `rc`; `what` names the rule or step.
[[noreturn]] void fail(const std::string& what, int rc) {
    throw std::runtime_error(what + ": " + std::strerror(-rc));
}

std::string rule_name(std::string_view name) { return "seccomp rule " + std::string(name); }

/// One argument comparison (libseccomp's SCMP_CMP is a C compound literal).
scmp_arg_cmp compare(unsigned arg, scmp_compare op, std::uint64_t a, std::uint64_t b = 0) {
    return scmp_arg_cmp{arg, op, a, b};
}

std::uint32_t to_scmp(rules::action act) {
    return act == rules::action::enosys ? SCMP_ACT_ERRNO(ENOSYS) : SCMP_ACT_ERRNO(EPERM);
}

/// The native syscall number of a rule's syscall, or -1 when this architecture lacks it and
/// rules::absent_here says so. Throws for any other name libseccomp cannot resolve here.
int resolve(std::string_view name) {
    // seccomp_syscall_resolve_name answers a negative pseudo-number for a syscall it knows
    // but this architecture lacks (stime on x86_64), and __NR_SCMP_ERROR for an unknown name.
    int nr = seccomp_syscall_resolve_name(std::string(name).c_str());
    if (nr >= 0) return nr;
    if (std::ranges::find(rules::absent_here, name) != std::ranges::end(rules::absent_here))
        return -1;
    throw std::runtime_error(rule_name(name) +
                             ": no such syscall on this architecture (a typo, or a name to "
                             "list in absent_here of seccomp_rules.hpp)");
}

void add(scmp_filter_ctx ctx, std::string_view name, rules::action act, int nr,
         const std::vector<scmp_arg_cmp>& cmps) {
    // _exact: the rule goes in as written or fails, never rewritten (e.g. into socketcall).
    int rc = seccomp_rule_add_exact_array(ctx, to_scmp(act), nr, static_cast<unsigned>(cmps.size()),
                                          cmps.data());
    if (rc < 0) fail(rule_name(name) + ": seccomp_rule_add", rc);
}

void add_arg_rule(scmp_filter_ctx ctx, const rules::arg_rule& rule, int nr) {
    switch (rule.test) {
        case rules::arg_test::any_bit:
            // A comparison is one masked equality, so "any of these bits" is one rule per bit.
            for (std::uint64_t bits = rule.value; bits != 0; bits &= bits - 1) {
                std::uint64_t bit = bits & -bits;
                add(ctx, rule.name, rule.act, nr,
                    {compare(rule.arg, SCMP_CMP_MASKED_EQ, bit, bit)});
            }
            return;
        case rules::arg_test::low32_eq:
            // The kernel reads an int or u32 here and ignores the upper half of the register: so
            // must the filter, or 0x1'00005412 would pass as a TIOCSTI that is not one.
            add(ctx, rule.name, rule.act, nr,
                {compare(rule.arg, SCMP_CMP_MASKED_EQ, 0xffffffffULL, rule.value)});
            return;
        case rules::arg_test::persona_bits: {
            // Denied: any x > 0xffffffff (the kernel would truncate it: fail closed), and any
            // 32-bit x but 0xffffffff with a bit outside `value`. A rule holds one comparison per
            // argument, so the latter is a union of masked tests "bit b set, bit c clear", with b
            // outside `value` and c anywhere (so x is not 0xffffffff). With o[] the outside bits:
            // (o[i], o[i+1 mod n]) catches an x whose outside bits are neither all clear nor all
            // set; (o[0], v) for each bit v of `value` catches one whose outside bits are all set.
            std::vector<std::uint64_t> outside;
            for (unsigned b = 0; b < 32; ++b) {
                if ((rule.value >> b & 1) == 0) outside.push_back(std::uint64_t{1} << b);
            }
            if (outside.size() < 2)
                throw std::logic_error(rule_name(rule.name) + ": too few bits left outside");
            auto set_and_clear = [&](std::uint64_t set, std::uint64_t clear) {
                add(ctx, rule.name, rule.act, nr,
                    {compare(rule.arg, SCMP_CMP_MASKED_EQ, set | clear, set)});
            };
            for (std::size_t i = 0; i < outside.size(); ++i)
                set_and_clear(outside[i], outside[(i + 1) % outside.size()]);
            for (std::uint64_t bits = rule.value; bits != 0; bits &= bits - 1)
                set_and_clear(outside[0], bits & -bits);
            add(ctx, rule.name, rule.act, nr, {compare(rule.arg, SCMP_CMP_GT, 0xffffffffULL)});
            return;
        }
    }
    throw std::logic_error(rule_name(rule.name) + ": unknown argument test");
}

/// libseccomp writes the program only to a descriptor (seccomp_export_bpf_mem is 2.6): a memfd
/// keeps it in memory.
std::string export_program(scmp_filter_ctx ctx) {
    unique_fd fd{::memfd_create("sandboxd-seccomp", MFD_CLOEXEC)};
    if (!fd) throw std::system_error(errno, std::system_category(), "seccomp filter: memfd_create");
    if (int rc = seccomp_export_bpf(ctx, fd.get()); rc < 0)
        fail("seccomp filter: seccomp_export_bpf", rc);
    struct stat st {};
    if (::fstat(fd.get(), &st) != 0)
        throw std::system_error(errno, std::system_category(), "seccomp filter: fstat");
    std::string program(static_cast<std::size_t>(st.st_size), '\0');
    std::size_t done = 0;
    while (done < program.size()) {
        ssize_t n = ::pread(fd.get(), program.data() + done, program.size() - done,
                            static_cast<off_t>(done));
        if (n < 0 && errno == EINTR) continue;
        if (n <= 0)
            throw std::system_error(n < 0 ? errno : EIO, std::system_category(),
                                    "seccomp filter: reading the program back");
        done += static_cast<std::size_t>(n);
    }
    return program;
}

std::string compile() {
    // Allow by default: the rules list what is denied (a default-deny list would break every
    // program that uses a syscall newer than the list).
    filter_ctx ctx{seccomp_init(SCMP_ACT_ALLOW)};
    if (!ctx) throw std::runtime_error("seccomp filter: seccomp_init failed");
    // The context holds the native architecture only. Syscalls of any other (i386 through
    // int 0x80 on x86_64) would be looked up in another table, under other numbers, where none
    // of the rules apply: they are refused. x32 shares x86_64's audit architecture, and
    // libseccomp refuses its numbers (bit 30 set) with the same action.
    if (int rc = seccomp_attr_set(ctx.get(), SCMP_FLTATR_ACT_BADARCH, SCMP_ACT_ERRNO(EPERM));
        rc < 0)
        fail("seccomp filter: SCMP_FLTATR_ACT_BADARCH", rc);
    for (const auto& rule : rules::plain_rules) {
        if (int nr = resolve(rule.name); nr >= 0) add(ctx.get(), rule.name, rule.act, nr, {});
    }
    for (const auto& rule : rules::arg_rules) {
        if (int nr = resolve(rule.name); nr >= 0) add_arg_rule(ctx.get(), rule, nr);
    }
    // A binary tree of the syscall numbers (level 2) rather than a list of them. Since 5.11
    // the kernel caches, per syscall number, a verdict that does not depend on the arguments,
    // so only the argument-filtered calls (clone, unshare, personality, ioctl, socket) run
    // the program at all; but to fill that cache, each channel's seccomp(2) runs the program
    // once for every syscall number of the architecture, in a few comparisons with a tree and
    // down the whole list without one. Measured on 2 cores (issue 19): 0.33 -> 0.23 ms per
    // seccomp(2) for 236 -> 252 instructions (a trivial one-instruction filter: 0.13 ms).
    if (int rc = seccomp_attr_set(ctx.get(), SCMP_FLTATR_CTL_OPTIMIZE, 2); rc < 0)
        fail("seccomp filter: SCMP_FLTATR_CTL_OPTIMIZE", rc);
    return export_program(ctx.get());
}

}  // namespace

std::string build_seccomp_filter() {
    // The program never changes within a process: compile it once. A function-local static is
    // initialised once even under concurrent first calls, which also keeps libseccomp's own
    // lazily probed globals away from concurrent use; a throw leaves it for the next call.
    static const std::string program = compile();
    return program;
}

}  // namespace sandboxd::detail
