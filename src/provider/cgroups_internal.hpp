#pragma once
/// @file cgroups_internal.hpp
/// What cgroups.cpp (the manager, lease and channel cgroups) and cgroups_probe.cpp (the probe
/// that fixes the Layout and makes the manager) share. Private to the provider layer, and
/// within it to those two files: everyone else uses cgroups.hpp.

#include "provider/cgroups.hpp"

#include <cstddef>
#include <filesystem>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

namespace sandboxd::detail::cgroups_detail {

namespace fs = std::filesystem;

/// The controllers the instance cgroup and each lease cgroup enable for their children (v2).
inline constexpr const char* v2_controllers = "+memory +pids +cpu";
inline constexpr const char* v2_controllers_io = "+memory +pids +cpu +io";

// --- The layout fixed by the probe. ---

struct Hierarchy {
    std::string controllers;  // "memory", "cpu,cpuacct", ... ("" for v2)
    fs::path instance;        // <this process's cgroup>/<instance> in this hierarchy
    // v1 blkio: channels stay in their lease's cgroup (its throttles are not hierarchical).
    bool flat = false;
};

struct Layout {
    cgroup_mode mode = cgroup_mode::none;
    std::vector<Hierarchy> hierarchies;
    // Indexes into hierarchies (all 0 on v2).
    std::size_t memory = 0, pids = 0, cpu = 0, cpuacct = 0, freezer = 0;
    bool memsw = false;                // v1: memory.memsw.* exist (swap accounting on)
    std::optional<std::size_t> blkio;  // v1: the blkio hierarchy, when there is one
    bool io = false;                   // v2: the io controller is enabled for the leases

    fs::path dir(std::size_t h, const std::string& rel) const {
        return hierarchies[h].instance / rel;
    }
    /// Whether `rel` is a channel's cgroup (lease/channel), which a flat hierarchy has not.
    bool absent_in(std::size_t h, const std::string& rel) const {
        return hierarchies[h].flat && rel.find('/') != std::string::npos;
    }
    /// Where a process of `rel` lives in hierarchy `h`: its lease's cgroup in a flat one.
    fs::path home(std::size_t h, const std::string& rel) const {
        return absent_in(h, rel) ? dir(h, rel.substr(0, rel.find('/'))) : dir(h, rel);
    }
};

/// The manager of `layout` (mode none: one whose create_lease throws), describe() giving
/// `description`.
std::unique_ptr<CgroupManager> make_manager(std::shared_ptr<const Layout> layout,
                                            std::string description);

// --- Errors. ---

/// Throws provider_error "<what>: <errno text>", or channel_limit when `err` is EMFILE or
/// ENFILE (the node has no descriptor left).
[[noreturn]] void throw_errno(const std::string& what, int err);
/// Throws provider_error unless `name` is 1..64 of [A-Za-z0-9_-]; `what` says whose name.
void check_name(const std::string& name, const char* what);

// --- Small cgroupfs and procfs files. ---

/// The whole file; nullopt (errno set) when it cannot be read.
std::optional<std::string> read_text(const fs::path& path);
/// 0 or the errno of opening or writing. cgroupfs takes a value in one write.
int try_write(const fs::path& path, std::string_view value) noexcept;
/// As try_write; throws provider_error when it fails.
void write_value(const fs::path& path, std::string_view value);
/// The non-empty parts of `s` between any of `seps`.
std::vector<std::string> split(std::string_view s, std::string_view seps);

}  // namespace sandboxd::detail::cgroups_detail
