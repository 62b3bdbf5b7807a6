// Lease disks (src/provider/lease_disk.hpp) against the real kernel: loop devices, ext4, mount.
// Needs root. Each test works in a directory of its own from mkdtemp and finds its loop device
// only through its own mount or its own image path, since other tests run in parallel.

#include "provider/lease_disk.hpp"

#include <sandboxd/core/errors.hpp>
#include <sandboxd/core/unique_fd.hpp>

#include <catch2/catch.hpp>

#include <fcntl.h>
#include <sys/mount.h>
#include <sys/stat.h>
#include <sys/statvfs.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <functional>
#include <optional>
#include <sstream>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

namespace {

using namespace sandboxd;
using namespace sandboxd::detail;
namespace fs = std::filesystem;
using Clock = std::chrono::steady_clock;

constexpr std::uint64_t mib = 1ULL << 20;
constexpr uid_t tenant = 123456;

void check(bool ok, const std::string& what) {
    if (!ok) throw std::runtime_error(what + ": " + std::strerror(errno));
}

void destroy_quietly(const fs::path& dir) {
    try {
        destroy_lease_disk(dir);
    } catch (const std::exception& e) {
        WARN("cannot destroy the disk in " << dir << ": " << e.what());
    }
}

/// A directory of this test's own, with whatever disk it holds destroyed on the way out.
struct temp_dir {
    fs::path path;
    temp_dir() {
        char name[] = "/tmp/sandboxd-disk-test-XXXXXX";
        check(::mkdtemp(name) != nullptr, "mkdtemp");
        path = name;
    }
    ~temp_dir() {
        destroy_quietly(path);
        try {
            remove_tree_bounded(path);
        } catch (const std::exception& e) {
            WARN("cannot clean up " << path << ": " << e.what());
        }
    }
    temp_dir(const temp_dir&) = delete;
    temp_dir& operator=(const temp_dir&) = delete;
    temp_dir(temp_dir&&) = delete;
    temp_dir& operator=(temp_dir&&) = delete;
};

struct mount_entry {
    std::string options;  ///< per-mount options, e.g. "rw,nosuid,nodev,relatime"
    std::string fstype;
    std::string source;  ///< e.g. "/dev/loop3"
};

/// The topmost mount at `mountpoint` in /proc/self/mountinfo (paths here have no spaces).
std::optional<mount_entry> find_mount(const fs::path& mountpoint) {
    std::ifstream in("/proc/self/mountinfo");
    std::optional<mount_entry> found;
    for (std::string line; std::getline(in, line);) {
        std::istringstream fields(line);
        std::string id, parent, devno, root, point, options, field;
        fields >> id >> parent >> devno >> root >> point >> options;
        if (point != mountpoint.string()) continue;
        while (fields >> field && field != "-") {
        }
        mount_entry entry{options, "", ""};
        fields >> entry.fstype >> entry.source;
        found = entry;
    }
    return found;
}

bool has_option(const std::string& options, const std::string& option) {
    return ("," + options + ",").find("," + option + ",") != std::string::npos;
}

/// What /sys says loop device `device` ("/dev/loopN") is backed by; "" when it is unbound.
std::string backing_file(const std::string& device) {
    std::ifstream in("/sys/block/" + fs::path(device).filename().string() + "/loop/backing_file");
    std::string file;
    std::getline(in, file);
    return file;
}

/// Whether any loop device is backed by `image` (a path that only this test uses).
bool image_is_attached(const fs::path& image) {
    for (const auto& entry : fs::directory_iterator("/sys/block")) {
        std::string name = entry.path().filename().string();
        if (name.rfind("loop", 0) == 0 && backing_file("/dev/" + name) == image.string()) {
            return true;
        }
    }
    return false;
}

int open_fd_count() {
    int n = 0;
    for ([[maybe_unused]] const auto& entry : fs::directory_iterator("/proc/self/fd")) ++n;
    return n;
}

/// A "VmRSS"/"VmHWM" line of /proc/self/status, in bytes.
std::uint64_t status_bytes(const std::string& key) {
    std::ifstream in("/proc/self/status");
    for (std::string line; std::getline(in, line);) {
        if (line.rfind(key + ":", 0) == 0) return std::stoull(line.substr(key.size() + 1)) * 1024;
    }
    throw std::runtime_error("no " + key + " in /proc/self/status");
}

/// Resets VmHWM to the current RSS, so that a later VmHWM is the peak since now.
void reset_peak_rss() {
    std::ofstream out("/proc/self/clear_refs");
    out << "5";
}

std::uint64_t host_free_bytes(const fs::path& dir) {
    struct statvfs st {};
    check(::statvfs(dir.c_str(), &st) == 0, "statvfs");
    return static_cast<std::uint64_t>(st.f_bavail) * st.f_frsize;
}

/// Nests `depth` directories "d" under `top`, spreads `files` one-byte files over them, and
/// calls `at_level` with each level's descriptor once its children exist. Only two
/// descriptors are open at a time, whatever the depth.
void build_deep_tree(const fs::path& top, int depth, int files,
                     const std::function<void(int, int)>& at_level = {}) {
    unique_fd dir(::open(top.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC));
    check(static_cast<bool>(dir), "open " + top.string());
    for (int level = 0; level < depth; ++level) {
        int quota = files / depth + (level < files % depth ? 1 : 0);
        for (int i = 0; i < quota; ++i) {
            std::string name = "f" + std::to_string(i);
            unique_fd file(
                ::openat(dir.get(), name.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0644));
            check(file && ::write(file.get(), "x", 1) == 1, "create a file");
        }
        check(::mkdirat(dir.get(), "d", 0755) == 0, "mkdirat");
        unique_fd next(::openat(dir.get(), "d", O_RDONLY | O_DIRECTORY | O_CLOEXEC));
        check(static_cast<bool>(next), "openat");
        if (at_level) at_level(dir.get(), level);
        dir = std::move(next);
    }
}

/// Runs `undo` on the way out of a scope (a mount or a disk made outside the temp_dir's reach).
template <class F>
struct scope_guard {
    F undo;
    explicit scope_guard(F f) : undo(std::move(f)) {}
    ~scope_guard() { undo(); }
    scope_guard(const scope_guard&) = delete;
    scope_guard& operator=(const scope_guard&) = delete;
    scope_guard(scope_guard&&) = delete;
    scope_guard& operator=(scope_guard&&) = delete;
};

void unmount_quietly(const fs::path& path) { ::umount2(path.c_str(), MNT_DETACH); }

double ms_since(Clock::time_point start) {
    return std::chrono::duration<double, std::milli>(Clock::now() - start).count();
}

void touch(const fs::path& path) {
    unique_fd file(::open(path.c_str(), O_WRONLY | O_CREAT | O_CLOEXEC, 0644));
    check(static_cast<bool>(file), "create " + path.string());
}

}  // namespace

TEST_CASE("A lease disk is an ext4 filesystem of its own, owned by the lease, nosuid and nodev",
          "[disk]") {
    temp_dir dir;
    auto start = Clock::now();
    fs::path workspace = create_lease_disk(dir.path, 64 * mib, tenant, tenant);
    INFO("create took " << ms_since(start) << " ms");

    CHECK(workspace == dir.path / "workspace");
    struct stat root {};
    REQUIRE(::stat(workspace.c_str(), &root) == 0);
    CHECK(root.st_uid == tenant);
    CHECK(root.st_gid == tenant);
    CHECK((root.st_mode & 07777) == 0755);

    auto mount = find_mount(workspace);
    REQUIRE(mount);
    CHECK(mount->fstype == "ext4");
    CHECK(has_option(mount->options, "nosuid"));
    CHECK(has_option(mount->options, "nodev"));
    CHECK(backing_file(mount->source) == (dir.path / "disk.img").string());
    CHECK(fs::file_size(dir.path / "disk.img") == 64 * mib);

    // The raw image is root's alone.
    struct stat image {};
    REQUIRE(::stat((dir.path / "disk.img").c_str(), &image) == 0);
    CHECK((image.st_mode & 07777) == 0600);
}

TEST_CASE("Disks of one size made from the kept format are separate filesystems of their owners",
          "[disk]") {
    // The first disk of a size is formatted by mkfs.ext4, the later ones are written from the
    // bytes it kept (lease_disk.hpp): each must still be a filesystem of its own, owned by its
    // own lease, with room for the same number of files and bytes.
    temp_dir a, b, c;
    const std::uint64_t size = 40 * mib;  // a size no other test of this process uses first
    fs::path first = create_lease_disk(a.path, size, tenant, tenant);
    scope_guard undo_a([&] { destroy_lease_disk(a.path); });
    fs::path second = create_lease_disk(b.path, size, tenant + 1, tenant + 2);
    scope_guard undo_b([&] { destroy_lease_disk(b.path); });
    fs::path third = create_lease_disk(c.path, size, tenant, tenant);
    scope_guard undo_c([&] { destroy_lease_disk(c.path); });

    struct stat root {};
    REQUIRE(::stat(second.c_str(), &root) == 0);
    CHECK(root.st_uid == tenant + 1);
    CHECK(root.st_gid == tenant + 2);
    CHECK((root.st_mode & 07777) == 0755);
    for (const auto& w : {first, second, third}) {
        INFO(w);
        auto mount = find_mount(w);
        REQUIRE(mount);
        CHECK(mount->fstype == "ext4");
        struct statvfs st {};
        REQUIRE(::statvfs(w.c_str(), &st) == 0);
        struct statvfs st1 {};
        REQUIRE(::statvfs(first.c_str(), &st1) == 0);
        CHECK(st.f_blocks == st1.f_blocks);
        CHECK(st.f_files == st1.f_files);
        CHECK(fs::file_size(w.parent_path() / "disk.img") == size);
    }
    touch(first / "only-in-first");
    touch(third / "only-in-third");
    CHECK(fs::exists(first / "only-in-first"));
    CHECK_FALSE(fs::exists(second / "only-in-first"));
    CHECK_FALSE(fs::exists(third / "only-in-first"));
    CHECK_FALSE(fs::exists(first / "only-in-third"));
    // The disk made between them holds nothing but what mkfs made.
    std::size_t entries = 0;
    for (const auto& e : fs::directory_iterator(second)) {
        entries += e.path().filename() == "lost+found" ? 0 : 1;
    }
    CHECK(entries == 0);
}

TEST_CASE("Writing past the size of a lease disk fails with ENOSPC and costs the host no more",
          "[disk]") {
    temp_dir dir;
    // The image on a filesystem of the test's own, so that no other test's writes count.
    const fs::path host = dir.path / "host";
    const fs::path lease = host / "lease";
    REQUIRE(fs::create_directory(host));
    REQUIRE(::mount("tmpfs", host.c_str(), "tmpfs", MS_NOSUID | MS_NODEV, "size=256m") == 0);
    scope_guard unmount_host([&] { unmount_quietly(host); });
    REQUIRE(fs::create_directory(lease));
    std::uint64_t free_before = host_free_bytes(lease);
    fs::path workspace = create_lease_disk(lease, 64 * mib, tenant, tenant);
    scope_guard destroy_disk([&] { destroy_quietly(lease); });

    unique_fd file(::open((workspace / "big").c_str(), O_WRONLY | O_CREAT | O_CLOEXEC, 0644));
    REQUIRE(file);
    std::vector<char> chunk(mib, 'x');
    int write_errno = 0;
    for (std::uint64_t written = 0; written < 100 * mib && write_errno == 0;) {
        ssize_t n = ::write(file.get(), chunk.data(), chunk.size());
        if (n < 0) {
            write_errno = errno;
        } else {
            written += static_cast<std::uint64_t>(n);
        }
    }
    CHECK(write_errno == ENOSPC);
    file.reset();
    // Down to the image, so that the host's accounting sees all of it.
    unique_fd root(::open(workspace.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC));
    REQUIRE(root);
    CHECK(::syncfs(root.get()) == 0);
    root.reset();

    std::uint64_t used = disk_used_bytes(workspace);
    CHECK(used > 50 * mib);
    CHECK(used <= 64 * mib);
    std::uint64_t free_after = host_free_bytes(lease);
    CHECK(free_after + 65 * mib >= free_before);
    CHECK(free_after + 50 * mib < free_before);  // the data did reach the image
}

TEST_CASE("Destroying a lease disk removes its mount, image and loop device, and may be repeated",
          "[disk]") {
    temp_dir dir;
    fs::path workspace = create_lease_disk(dir.path, 64 * mib, tenant, tenant);
    auto mount = find_mount(workspace);
    REQUIRE(mount);
    const fs::path image = dir.path / "disk.img";
    REQUIRE(backing_file(mount->source) == image.string());
    touch(workspace / "left-behind");

    auto start = Clock::now();
    destroy_lease_disk(dir.path);
    INFO("destroy took " << ms_since(start) << " ms");

    CHECK_FALSE(find_mount(workspace));
    CHECK_FALSE(fs::exists(workspace));
    CHECK_FALSE(fs::exists(image));
    // The device may already serve someone else; it must not name our image any more.
    CHECK(backing_file(mount->source).rfind(image.string(), 0) == std::string::npos);
    CHECK(disk_used_bytes(workspace) == 0);

    CHECK_NOTHROW(destroy_lease_disk(dir.path));
    CHECK(fs::is_directory(dir.path));
}

TEST_CASE("Destroying where the workspace is a plain directory leaves it to remove_tree_bounded",
          "[disk]") {
    temp_dir dir;
    const fs::path workspace = dir.path / "workspace";
    REQUIRE(fs::create_directories(workspace / "sub"));
    touch(workspace / "sub" / "file");

    CHECK_NOTHROW(destroy_lease_disk(dir.path));
    CHECK(fs::is_regular_file(workspace / "sub" / "file"));
    remove_tree_bounded(workspace);
    CHECK_FALSE(fs::exists(workspace));
}

TEST_CASE("Destroying shuts down only the lease's own disk, not a filesystem mounted in its place",
          "[disk]") {
    temp_dir owner;
    temp_dir other;
    fs::path workspace = create_lease_disk(owner.path, 64 * mib, tenant, tenant);
    const fs::path impostor = other.path / "workspace";
    REQUIRE(fs::create_directory(impostor));
    REQUIRE(::mount(workspace.c_str(), impostor.c_str(), nullptr, MS_BIND, nullptr) == 0);
    scope_guard unmount_impostor([&] { unmount_quietly(impostor); });

    destroy_lease_disk(other.path);
    CHECK_FALSE(find_mount(impostor));
    CHECK_FALSE(fs::exists(impostor));
    // Shut down, the disk would answer EIO.
    touch(workspace / "still-writable");
    CHECK(fs::is_regular_file(workspace / "still-writable"));
}

TEST_CASE("Creating a lease disk where one exists fails and leaves the existing disk intact",
          "[disk]") {
    temp_dir dir;
    fs::path workspace = create_lease_disk(dir.path, 64 * mib, tenant, tenant);
    touch(workspace / "marker");
    auto mount = find_mount(workspace);
    REQUIRE(mount);

    try {
        create_lease_disk(dir.path, 64 * mib, 1, 1);
        FAIL("a second disk was created");
    } catch (const rpc_error& e) {
        CHECK(e.code() == errc::provider_error);
        CHECK(std::string(e.what()) == dir.path.string() + " already holds a disk");
    }
    auto still = find_mount(workspace);
    REQUIRE(still);
    CHECK(still->source == mount->source);
    CHECK(fs::exists(workspace / "marker"));
    CHECK(backing_file(mount->source) == (dir.path / "disk.img").string());
}

TEST_CASE("A lease disk that cannot be created leaves nothing behind", "[disk]") {
    temp_dir dir;
    const fs::path image = dir.path / "disk.img";

    SECTION("in a directory that does not exist") {
        fs::path missing = dir.path / "missing";
        try {
            create_lease_disk(missing, 64 * mib, tenant, tenant);
            FAIL("created");
        } catch (const rpc_error& e) {
            CHECK(e.code() == errc::provider_error);
            CHECK(std::string(e.what()) == "cannot create " + (missing / "disk.img").string() +
                                               ": No such file or directory");
        }
        CHECK_FALSE(fs::exists(missing));
    }
    SECTION("of a size out of range") {
        CHECK_THROWS_WITH(create_lease_disk(dir.path, min_disk_bytes - 4096, tenant, tenant),
                          Catch::Contains("is outside"));
        CHECK_THROWS_WITH(create_lease_disk(dir.path, max_disk_bytes + 4096, tenant, tenant),
                          Catch::Contains("is outside"));
        CHECK_FALSE(fs::exists(image));
    }
    SECTION("when its mountpoint is taken, after the loop device was attached") {
        touch(dir.path / "workspace");
        try {
            create_lease_disk(dir.path, 64 * mib, tenant, tenant);
            FAIL("created");
        } catch (const rpc_error& e) {
            CHECK(e.code() == errc::provider_error);
            CHECK(std::string(e.what()) == "cannot create the mountpoint " +
                                               (dir.path / "workspace").string() + ": File exists");
        }
        CHECK_FALSE(fs::exists(image));
        CHECK_FALSE(image_is_attached(image));
        CHECK(fs::is_regular_file(dir.path / "workspace"));
        CHECK_FALSE(find_mount(dir.path / "workspace"));
        fs::remove(dir.path / "workspace");
    }
    CHECK(fs::is_empty(dir.path));
}

TEST_CASE("Tearing down a lease disk costs the same memory and descriptors whatever it holds",
          "[disk]") {
    temp_dir dir;
    // 4 GiB: at one inode per 16 KiB that is 262,144 inodes for the 130,000 made here.
    fs::path workspace = create_lease_disk(dir.path, 4096 * mib, tenant, tenant);
    auto built = Clock::now();
    build_deep_tree(workspace, 30000, 100000);
    INFO("building the tree took " << ms_since(built) << " ms");
    auto mount = find_mount(workspace);
    REQUIRE(mount);

    int fds_before = open_fd_count();
    reset_peak_rss();
    std::uint64_t rss_before = status_bytes("VmRSS");
    auto start = Clock::now();
    destroy_lease_disk(dir.path);
    double took = ms_since(start);
    std::uint64_t peak = status_bytes("VmHWM");
    INFO("destroy took " << took << " ms, RSS growth " << (peak - rss_before) / 1024 << " KiB");

    CHECK(peak < rss_before + 16 * mib);
    CHECK(open_fd_count() == fds_before);
    CHECK_FALSE(find_mount(workspace));
    CHECK_FALSE(fs::exists(dir.path / "disk.img"));
    CHECK(backing_file(mount->source).rfind((dir.path / "disk.img").string(), 0) ==
          std::string::npos);
}

TEST_CASE("A plain tree is removed whatever its depth and modes, without following symlinks",
          "[disk]") {
    temp_dir dir;
    // On a tmpfs of its own: on this host's journalled ext4, each rmdir waited 1-3 ms for the
    // journal while builds ran alongside, 30-90 s for the 30,000 levels.
    const fs::path scratch = dir.path / "scratch";
    REQUIRE(fs::create_directory(scratch));
    REQUIRE(::mount("tmpfs", scratch.c_str(), "tmpfs", MS_NOSUID | MS_NODEV, "size=64m") == 0);
    scope_guard unmount_scratch([&] { unmount_quietly(scratch); });
    const fs::path tree = scratch / "tree";
    const fs::path outside = scratch / "outside";
    REQUIRE(fs::create_directories(outside / "sub"));
    touch(outside / "a");
    touch(outside / "sub" / "b");
    REQUIRE(fs::create_directory(tree));
    fs::create_directory_symlink(outside, tree / "link");

    build_deep_tree(tree, 30000, 3000, [&](int level_fd, int level) {
        if (level % 1000 == 10) {
            check(::symlinkat(outside.c_str(), level_fd, "link") == 0, "symlinkat");
        } else if (level % 1000 == 1) {
            check(::fchmod(level_fd, 0500) == 0, "fchmod 0500");  // holds d, at first f0
        } else if (level % 1000 == 2) {
            check(::fchmod(level_fd, 0) == 0, "fchmod 000");
        }
    });

    int fds_before = open_fd_count();
    reset_peak_rss();
    std::uint64_t rss_before = status_bytes("VmRSS");
    remove_tree_bounded(tree);
    CHECK(status_bytes("VmHWM") < rss_before + 16 * mib);
    CHECK(open_fd_count() == fds_before);

    CHECK_FALSE(fs::exists(fs::symlink_status(tree)));
    CHECK(fs::is_regular_file(outside / "a"));
    CHECK(fs::is_regular_file(outside / "sub" / "b"));
    CHECK_NOTHROW(remove_tree_bounded(tree));
}

TEST_CASE("A tree that cannot be removed entirely is reported", "[disk]") {
    temp_dir dir;
    const fs::path tree = dir.path / "tree";
    const fs::path other = tree / "other-fs";
    REQUIRE(fs::create_directories(other));
    touch(tree / "file");
    REQUIRE(::mount("tmpfs", other.c_str(), "tmpfs", MS_NOSUID | MS_NODEV, "size=1m") == 0);
    scope_guard unmount_other([&] { unmount_quietly(other); });
    touch(other / "kept");

    try {
        remove_tree_bounded(tree);
        FAIL("removed");
    } catch (const rpc_error& e) {
        CHECK(e.code() == errc::provider_error);
        CHECK_THAT(e.what(),
                   Catch::StartsWith("cannot remove " + tree.string() + ": rm: exit status 1: "));
    }
    // rm stayed on its filesystem: the other one is untouched, the rest is gone.
    CHECK(fs::exists(other / "kept"));
    CHECK_FALSE(fs::exists(tree / "file"));
}
