/// @file cgroups_probe.cpp
/// probe_cgroups() (see cgroups.hpp): finds which mechanism this machine offers, v2 first,
/// from /proc/self/mountinfo and /proc/self/cgroup, and fixes the Layout that the manager
/// (cgroups.cpp) then works in: where the instance subtree lives in each hierarchy used and
/// which hierarchy carries which controller. Setting it up moves this process into a v2 leaf
/// and makes the instance directories.

#include "provider/cgroups.hpp"

#include "provider/cgroups_internal.hpp"

#include <linux/magic.h>
#include <sys/stat.h>
#include <sys/statfs.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <charconv>
#include <cstddef>
#include <filesystem>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <system_error>
#include <utility>
#include <vector>

namespace sandboxd::detail::cgroups_detail {
namespace {

struct Mount {
    std::string root, point, fstype, options;
};

/// /proc/self/mountinfo fields use octal escapes for space, tab, newline and backslash.
std::string unescape(std::string_view s) {
    std::string out;
    for (std::size_t i = 0; i < s.size(); ++i) {
        if (s[i] == '\\' && i + 3 < s.size()) {
            int v = 0;
            auto [p, ec] = std::from_chars(s.data() + i + 1, s.data() + i + 4, v, 8);
            if (ec == std::errc() && p == s.data() + i + 4) {
                out.push_back(static_cast<char>(v));
                i += 3;
                continue;
            }
        }
        out.push_back(s[i]);
    }
    return out;
}

bool has_token(std::string_view list, std::string_view token, std::string_view seps) {
    auto tokens = split(list, seps);
    return std::find(tokens.begin(), tokens.end(), token) != tokens.end();
}

std::vector<Mount> cgroup_mounts() {
    std::vector<Mount> mounts;
    for (const auto& line : split(read_text("/proc/self/mountinfo").value_or(""), "\n")) {
        // id parent dev root point options [optional...] - fstype source super-options
        auto f = split(line, " ");
        auto dash = std::find(f.begin(), f.end(), "-");
        if (f.size() < 5 || dash == f.end() || f.end() - dash < 4) continue;
        if (dash[1] != "cgroup" && dash[1] != "cgroup2") continue;
        mounts.push_back({unescape(f[3]), unescape(f[4]), dash[1], dash[3]});
    }
    return mounts;
}

/// "controllers" -> cgroup path lines of /proc/self/cgroup ("" controllers: the v2 line).
std::vector<std::pair<std::string, std::string>> own_cgroups() {
    std::vector<std::pair<std::string, std::string>> out;
    for (const auto& line : split(read_text("/proc/self/cgroup").value_or(""), "\n")) {
        auto first = line.find(':');
        auto second = line.find(':', first + 1);
        if (first == std::string::npos || second == std::string::npos) continue;
        out.emplace_back(line.substr(first + 1, second - first - 1), line.substr(second + 1));
    }
    return out;
}

/// Where cgroup `path` of a hierarchy shows in `mount` (whose root may be a subdirectory).
std::optional<fs::path> place(const Mount& mount, const std::string& path) {
    std::string_view rest = path;
    if (mount.root != "/") {
        if (path != mount.root && !path.starts_with(mount.root + "/")) return std::nullopt;
        rest.remove_prefix(mount.root.size());
    }
    auto below = fs::path(rest).relative_path();
    return below.empty() ? fs::path(mount.point) : fs::path(mount.point) / below;
}

/// `root` as mountinfo spells mount points (no trailing slash).
std::string mount_point_of(const fs::path& root) {
    auto r = root.lexically_normal().string();
    while (r.size() > 1 && r.back() == '/') r.pop_back();
    return r;
}

std::optional<Layout> probe_v2(const std::string& instance, const fs::path& root,
                               std::string& why) {
    struct statfs sfs {};
    if (::statfs(root.c_str(), &sfs) != 0 || sfs.f_type != CGROUP2_SUPER_MAGIC) {
        why = root.string() + " is not a cgroup2 mount";
        return std::nullopt;
    }
    std::optional<std::string> path;
    for (const auto& [controllers, p] : own_cgroups()) {
        if (controllers.empty()) path = p;
    }
    std::optional<fs::path> own;
    for (const auto& m : cgroup_mounts()) {
        if (m.fstype == "cgroup2" && path && m.point == mount_point_of(root)) own = place(m, *path);
    }
    if (!own) {
        why = "this process's cgroup is not visible under " + root.string();
        return std::nullopt;
    }
    // An earlier probe of this process moved it into <own>/daemon already.
    auto enabled = [](const fs::path& dir) {
        auto text = read_text(dir / "cgroup.subtree_control").value_or("");
        return has_token(text, "memory", " \n") && has_token(text, "pids", " \n") &&
               has_token(text, "cpu", " \n");
    };
    if (own->filename() == "daemon" && enabled(own->parent_path())) own = own->parent_path();
    auto available = read_text(*own / "cgroup.controllers").value_or("");
    for (const char* c : {"memory", "pids", "cpu"}) {
        if (!has_token(available, c, " \n")) {
            why = own->string() + " does not offer the " + c + " controller (Delegate=yes?)";
            return std::nullopt;
        }
    }
    if (::access(own->c_str(), W_OK) != 0) {
        why = own->string() + " is not writable";
        return std::nullopt;
    }
    Layout layout;
    layout.mode = cgroup_mode::v2;
    layout.io = has_token(available, "io", " \n");
    layout.hierarchies.push_back({"", *own / instance});
    return layout;
}

void setup_v2(const Layout& layout) {
    fs::path own = layout.hierarchies[0].instance.parent_path();
    fs::path leaf = own / "daemon";
    if (::mkdir(leaf.c_str(), 0755) != 0 && errno != EEXIST) {
        throw_errno("cannot make cgroup " + leaf.string(), errno);
    }
    // "No internal processes": <own> may enable controllers for its children only once every
    // process of it (this one, and whatever else the delegated unit runs) sits in a leaf.
    for (int round = 0; round < 10; ++round) {
        auto text = read_text(own / "cgroup.procs");
        if (!text) throw_errno("cannot read " + (own / "cgroup.procs").string(), errno);
        auto pids = split(*text, "\n");
        if (pids.empty()) break;
        for (const auto& pid : pids) {
            int err = try_write(leaf / "cgroup.procs", pid);
            if (err != 0 && err != ESRCH) {
                throw_errno("cannot move pid " + pid + " to " + leaf.string(), err);
            }
        }
    }
    const char* controllers = layout.io ? v2_controllers_io : v2_controllers;
    write_value(own / "cgroup.subtree_control", controllers);
    fs::path inst = layout.hierarchies[0].instance;
    if (::mkdir(inst.c_str(), 0755) != 0 && errno != EEXIST) {
        throw_errno("cannot make cgroup " + inst.string(), errno);
    }
    write_value(inst / "cgroup.subtree_control", controllers);
}

std::optional<Layout> probe_v1(const std::string& instance, const fs::path& root,
                               std::string& why) {
    auto mounts = cgroup_mounts();
    auto own = own_cgroups();
    Layout layout;
    std::vector<std::string> points;
    const std::pair<const char*, std::size_t Layout::*> roles[] = {{"memory", &Layout::memory},
                                                                   {"pids", &Layout::pids},
                                                                   {"cpu", &Layout::cpu},
                                                                   {"cpuacct", &Layout::cpuacct},
                                                                   {"freezer", &Layout::freezer}};
    for (const auto& [c, role] : roles) {
        const std::string* path = nullptr;
        for (const auto& [controllers, p] : own) {
            if (has_token(controllers, c, ",")) path = &p;
        }
        const Mount* mount = nullptr;
        for (const auto& m : mounts) {
            auto below = fs::path(m.point).lexically_relative(root.lexically_normal());
            if (m.fstype == "cgroup" && has_token(m.options, c, ",") && !below.empty() &&
                *below.begin() != "..") {
                mount = &m;
                break;
            }
        }
        auto dir = mount && path ? place(*mount, *path) : std::nullopt;
        if (!dir) {
            why = std::string("no cgroup v1 hierarchy with ") + c + " under " + root.string() +
                  " shows this process's cgroup";
            return std::nullopt;
        }
        if (::access(dir->c_str(), W_OK) != 0) {
            why = dir->string() + " is not writable";
            return std::nullopt;
        }
        // Co-mounted controllers ("cpu,cpuacct") share one hierarchy.
        auto at = std::find(points.begin(), points.end(), mount->point);
        layout.*role = static_cast<std::size_t>(at - points.begin());
        if (at == points.end()) {
            points.push_back(mount->point);
            layout.hierarchies.push_back({c, *dir / instance});
        } else {
            layout.hierarchies[layout.*role].controllers += std::string(",") + c;
        }
    }
    // blkio is optional: without it the node runs, and refuses io limits.
    const std::string* blkio_path = nullptr;
    for (const auto& [controllers, p] : own) {
        if (has_token(controllers, "blkio", ",")) blkio_path = &p;
    }
    for (const auto& m : mounts) {
        auto below = fs::path(m.point).lexically_relative(root.lexically_normal());
        if (blkio_path == nullptr || m.fstype != "cgroup" || !has_token(m.options, "blkio", ",") ||
            below.empty() || *below.begin() == "..") {
            continue;
        }
        auto dir = place(m, *blkio_path);
        if (!dir || ::access(dir->c_str(), W_OK) != 0) break;
        auto at = std::find(points.begin(), points.end(), m.point);
        if (at != points.end()) break;  // co-mounted with another controller: not flat, skip
        layout.blkio = layout.hierarchies.size();
        layout.hierarchies.push_back({"blkio", *dir / instance, true});
        break;
    }
    layout.mode = cgroup_mode::v1;
    return layout;
}

void setup_v1(Layout& layout) {
    for (const auto& h : layout.hierarchies) {
        if (::mkdir(h.instance.c_str(), 0755) != 0 && errno != EEXIST) {
            throw_errno("cannot make cgroup " + h.instance.string(), errno);
        }
    }
    // Channel cgroups must count against their lease's limit. Current kernels are always
    // hierarchical; older ones inherit the flag at mkdir, so set it on the instance directory.
    fs::path mem = layout.hierarchies[layout.memory].instance;
    if (read_text(mem / "memory.use_hierarchy").value_or("1").starts_with("0")) {
        write_value(mem / "memory.use_hierarchy", "1");
    }
    layout.memsw = ::access((mem / "memory.memsw.limit_in_bytes").c_str(), F_OK) == 0;
}

}  // namespace
}  // namespace sandboxd::detail::cgroups_detail

namespace sandboxd::detail {

std::unique_ptr<CgroupManager> probe_cgroups(const std::string& instance,
                                             const std::filesystem::path& root) {
    cgroups_detail::check_name(instance, "instance");
    std::string why_v2, why_v1;
    if (auto layout = cgroups_detail::probe_v2(instance, root, why_v2)) {
        cgroups_detail::setup_v2(*layout);
        auto what = std::string("cgroup v2 (memory, pids, cpu") + (layout->io ? ", io" : "") +
                    ") under " + layout->hierarchies[0].instance.string();
        return cgroups_detail::make_manager(
            std::make_shared<const cgroups_detail::Layout>(std::move(*layout)), std::move(what));
    }
    if (auto layout = cgroups_detail::probe_v1(instance, root, why_v1)) {
        cgroups_detail::setup_v1(*layout);
        std::string hierarchies;
        for (const auto& h : layout->hierarchies) {
            hierarchies += (hierarchies.empty() ? "" : ", ") + h.controllers;
        }
        auto where = layout->hierarchies[layout->memory].instance.string();
        return cgroups_detail::make_manager(
            std::make_shared<const cgroups_detail::Layout>(std::move(*layout)),
            "cgroup v1 (" + hierarchies + ") under " + where);
    }
    return cgroups_detail::make_manager(std::make_shared<const cgroups_detail::Layout>(),
                                        "no usable cgroups: v2: " + why_v2 + "; v1: " + why_v1);
}

}  // namespace sandboxd::detail
