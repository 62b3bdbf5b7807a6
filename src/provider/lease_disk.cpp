/// @file lease_disk.cpp
/// A lease's workspace as a loop-mounted ext4 image (see lease_disk.hpp), and the bounded
/// removal of a plain tree. Everything here runs on the caller's thread and blocks. Teardown
/// never walks the tenant's files: it shuts the filesystem down (so that nothing is written
/// back), detaches the mount and deletes the image.
///
/// Helper programs (mkfs.ext4, rm) are started with posix_spawn: glibc starts them with
/// clone(CLONE_VM | CLONE_VFORK), which is safe in a multi-threaded daemon without any code
/// of ours between fork and exec. They get a clean environment, stdin from /dev/null, no
/// descriptor of ours beyond their stdout and stderr (one pipe whose first 4 KiB we keep for
/// the error message), an empty signal mask and default dispositions; we reap exactly their
/// pid with waitpid.

#include "provider/lease_disk.hpp"

#include <sandboxd/core/errors.hpp>
#include <sandboxd/core/unique_fd.hpp>

#include <fcntl.h>
#include <linux/loop.h>
#include <linux/magic.h>
#include <spawn.h>
#include <sys/ioctl.h>
#include <sys/mman.h>
#include <sys/mount.h>
#include <sys/stat.h>
#include <sys/statfs.h>
#include <sys/statvfs.h>
#include <sys/syscall.h>
#include <sys/sysmacros.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cctype>
#include <cerrno>
#include <climits>
#include <csignal>
#include <cstring>
#include <initializer_list>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <string_view>
#include <system_error>
#include <utility>
#include <vector>

namespace sandboxd::detail {
namespace {

namespace fs = std::filesystem;

constexpr const char* image_name = "disk.img";
constexpr const char* workspace_name = "workspace";
constexpr std::size_t kept_output_bytes = 4096;
// LOOP_CTL_GET_FREE only names a device that was free a moment ago: another process (a test
// running in parallel, losetup, another daemon) may bind it before we do.
constexpr int loop_attempts = 8;
// Mounts stacked on one workspace that destroy will peel off before giving up.
constexpr int max_stacked_mounts = 8;
// ext4's shutdown ioctl and its "no log flush" mode (fs/ext4/ext4.h; not in the uapi headers).
constexpr unsigned long ext4_ioc_shutdown = _IOR('X', 125, std::uint32_t);
constexpr std::uint32_t ext4_going_flags_nologflush = 2;
// rm's address space: fts needs a few hundred bytes per level, so 30,000 levels fit easily;
// a runaway walk fails instead of taking the host's memory.
constexpr unsigned long long rm_address_space = 1ULL << 30;

[[noreturn]] void fail(const std::string& what, int err) {
    throw rpc_error(errc::provider_error, what + ": " + std::strerror(err));
}

std::string find_program(std::initializer_list<const char*> candidates) {
    for (const char* candidate : candidates) {
        if (::access(candidate, X_OK) == 0) return candidate;
    }
    throw rpc_error(errc::provider_error,
                    std::string("cannot find ") + *candidates.begin() + " (is it installed?)");
}

struct tool_result {
    int status = 0;
    std::string output;  ///< the first kept_output_bytes of stdout and stderr, interleaved
};

// posix_spawn's attribute and file-action objects, destroyed whatever happens (glibc's
// destroy functions accept the zeroed objects of a failed init).
struct spawn_setup {
    posix_spawn_file_actions_t actions{};
    posix_spawnattr_t attr{};
    int err;  ///< the first error of the setup, 0 if none

    /// `pass_fd` >= 0 becomes the tool's fd 3.
    explicit spawn_setup(int out_fd, int pass_fd = -1) : err(prepare(out_fd, pass_fd)) {}
    ~spawn_setup() {
        posix_spawn_file_actions_destroy(&actions);
        posix_spawnattr_destroy(&attr);
    }
    spawn_setup(const spawn_setup&) = delete;
    spawn_setup& operator=(const spawn_setup&) = delete;
    spawn_setup(spawn_setup&&) = delete;
    spawn_setup& operator=(spawn_setup&&) = delete;

private:
    int prepare(int out_fd, int pass_fd) {
        sigset_t none;
        sigset_t all;
        sigemptyset(&none);
        sigfillset(&all);
        int first = 0;
        const auto step = [&first](int result) { first = first != 0 ? first : result; };
        step(posix_spawn_file_actions_init(&actions));
        step(posix_spawnattr_init(&attr));
        step(posix_spawn_file_actions_addopen(&actions, 0, "/dev/null", O_RDONLY, 0));
        step(posix_spawn_file_actions_adddup2(&actions, out_fd, 1));
        step(posix_spawn_file_actions_adddup2(&actions, out_fd, 2));
        if (pass_fd >= 0) step(posix_spawn_file_actions_adddup2(&actions, pass_fd, 3));
        // Descriptors another thread opened without O_CLOEXEC must not leak into the tool.
        step(posix_spawn_file_actions_addclosefrom_np(&actions, pass_fd >= 0 ? 4 : 3));
        // The calling thread may block signals (Asio's signal handling does): the tool must
        // not inherit that, nor a disposition of ours.
        step(posix_spawnattr_setsigmask(&attr, &none));
        step(posix_spawnattr_setsigdefault(&attr, &all));
        step(posix_spawnattr_setflags(&attr, POSIX_SPAWN_SETSIGMASK | POSIX_SPAWN_SETSIGDEF));
        return first;
    }
};

// Runs `argv` (argv[0] an absolute path, no PATH search) to completion; `pass_fd` >= 0 is its
// fd 3.
tool_result run_tool(std::vector<std::string> argv, int pass_fd = -1) {
    const std::string what = "cannot run " + argv[0];
    int ends[2];
    if (::pipe2(ends, O_CLOEXEC) != 0) fail(what, errno);
    unique_fd read_end(ends[0]);
    unique_fd write_end(ends[1]);

    std::vector<char*> args;
    args.reserve(argv.size() + 1);
    for (auto& arg : argv) args.push_back(arg.data());
    args.push_back(nullptr);
    // C messages (parsed by nobody, but read by operators) and no MKE2FS_CONFIG or the like.
    char path_var[] = "PATH=/usr/sbin:/usr/bin:/sbin:/bin";
    char locale_var[] = "LC_ALL=C";
    char* envp[] = {path_var, locale_var, nullptr};

    pid_t pid = -1;
    {
        spawn_setup setup(write_end.get(), pass_fd);
        if (setup.err != 0) fail(what, setup.err);
        int err = posix_spawn(&pid, args[0], &setup.actions, &setup.attr, args.data(), envp);
        if (err != 0) fail(what, err);
    }
    write_end.reset();  // so that the read below sees EOF when the tool exits

    // Read to EOF whatever the volume (rm may complain about every entry), keeping the start.
    tool_result result;
    char buf[1024];
    for (;;) {
        ssize_t n = ::read(read_end.get(), buf, sizeof buf);
        if (n < 0 && errno == EINTR) continue;
        if (n <= 0) break;
        std::size_t room = kept_output_bytes - result.output.size();
        result.output.append(buf, std::min(room, static_cast<std::size_t>(n)));
    }
    read_end.reset();  // after a read error, the tool gets EPIPE rather than block forever
    while (::waitpid(pid, &result.status, 0) < 0) {
        if (errno != EINTR) fail("cannot wait for " + argv[0], errno);
    }
    while (!result.output.empty() &&
           std::isspace(static_cast<unsigned char>(result.output.back()))) {
        result.output.pop_back();
    }
    return result;
}

std::string describe(const tool_result& result) {
    std::string text = WIFEXITED(result.status)
                           ? "exit status " + std::to_string(WEXITSTATUS(result.status))
                           : "killed by signal " + std::to_string(WTERMSIG(result.status));
    return result.output.empty() ? text : text + ": " + result.output;
}

// The filesystem is throwaway (nothing ever mounts an image again after a crash or a
// reboot: the lease is gone), so it gets no journal: mkfs writes 140 KiB into a 64 MiB image
// instead of 4 MiB (1 GiB for 1 TiB), the tenant gets the whole size, and no jbd2 thread
// runs per lease. No lazy_itable_init option either: mke2fs discards the file first (punching
// holes, which read back as zeros), so it marks the inode tables zeroed without writing them
// and the kernel's ext4lazyinit thread never fills the image in behind us. Block size, inode
// size and ratio are explicit because mke2fs.conf's "small" type (under 512 MiB) would
// otherwise pick 1 KiB blocks and an inode per 4 KiB. `target` is a path mkfs opens: the image,
// or /proc/self/fd/3 for `pass_fd`.
void make_filesystem(const std::string& target, const std::string& image, uid_t uid, gid_t gid,
                     int pass_fd = -1) {
    const std::string mkfs = find_program({"/usr/sbin/mkfs.ext4", "/sbin/mkfs.ext4"});
    const std::string owner = std::to_string(uid) + ":" + std::to_string(gid);
    tool_result result = run_tool({mkfs, "-q", "-F", "-b", "4096", "-I", "256", "-i", "16384", "-m",
                                   "0", "-O", "^has_journal", "-E", "root_owner=" + owner, target},
                                  pass_fd);
    if (!WIFEXITED(result.status) || WEXITSTATUS(result.status) != 0) {
        throw rpc_error(errc::provider_error,
                        "mkfs.ext4 failed for " + image + ": " + describe(result));
    }
}

// --- Formatted images kept per size. ---
//
// mkfs.ext4 was most of a lease's creation (a process start and its own discard of the whole
// image, issue 19). So the first disk of a size is formatted in a memfd, the bytes mkfs wrote
// (about 140 KiB for 64 MiB: everything else reads as zeros) are kept with their offsets, and
// every disk of that size is a sparse file with those bytes written at those offsets. All
// disks of one size in one daemon process therefore share the filesystem's UUID and directory
// hash seed, which nothing in a sandbox can read (it has no access to the device or the image)
// and nothing outside uses (the images are never mounted by UUID). The root directory is
// root's in the kept image; create_lease_disk hands it to the lease's uid after the mount.

constexpr std::size_t max_kept_formats = 4;              // distinct sizes kept
constexpr std::uint64_t max_kept_format_data = 8 << 20;  // bytes written by mkfs, per size

struct kept_format {
    std::uint64_t bytes = 0;                                  // the image's size
    std::vector<std::pair<std::uint64_t, std::string>> data;  // offset, bytes: the rest is zeros
};

// The data extents of `fd` (SEEK_DATA / SEEK_HOLE), read into memory; nullopt past `limit`.
std::optional<kept_format> read_extents(int fd, std::uint64_t bytes, std::uint64_t limit) {
    kept_format format;
    format.bytes = bytes;
    std::uint64_t total = 0;
    off_t at = 0;
    for (;;) {
        const off_t begin = ::lseek(fd, at, SEEK_DATA);
        if (begin < 0) {
            if (errno == ENXIO) return format;  // no data past `at`
            fail("cannot read a formatted image", errno);
        }
        off_t end = ::lseek(fd, begin, SEEK_HOLE);
        if (end < 0) fail("cannot read a formatted image", errno);
        const auto size = static_cast<std::uint64_t>(end - begin);
        total += size;
        if (total > limit) return std::nullopt;
        std::string chunk(size, '\0');
        for (std::uint64_t done = 0; done < size;) {
            const ssize_t n = ::pread(fd, chunk.data() + done, size - done,
                                      static_cast<off_t>(static_cast<std::uint64_t>(begin) + done));
            if (n < 0 && errno == EINTR) continue;
            if (n <= 0) fail("cannot read a formatted image", n < 0 ? errno : EIO);
            done += static_cast<std::size_t>(n);
        }
        format.data.emplace_back(static_cast<std::uint64_t>(begin), std::move(chunk));
        at = end;
    }
}

// A formatted image of `bytes` made in a memfd by mkfs.ext4 (root directory root:root); nullopt
// when mkfs wrote more than max_kept_format_data.
std::optional<kept_format> make_kept_format(std::uint64_t bytes) {
    unique_fd memfd(
        static_cast<int>(::syscall(SYS_memfd_create, "sandboxd-disk-format", MFD_CLOEXEC)));
    if (!memfd) fail("cannot make a memfd to format a disk in", errno);
    if (::ftruncate(memfd.get(), static_cast<off_t>(bytes)) != 0) {
        fail("cannot size a memfd to format a disk in", errno);
    }
    make_filesystem("/proc/self/fd/3", "a disk of " + std::to_string(bytes) + " bytes", 0, 0,
                    memfd.get());
    return read_extents(memfd.get(), bytes, max_kept_format_data);
}

// The kept format for `bytes`, made on first use; nullptr when none can be kept (then every
// disk of that size runs mkfs). Thread-safe: a format is made once, under the lock.
std::shared_ptr<const kept_format> kept_format_for(std::uint64_t bytes) {
    static std::mutex mutex;
    static std::vector<std::shared_ptr<const kept_format>> kept;
    static std::vector<std::uint64_t> not_kept;
    const std::lock_guard lock(mutex);
    for (const auto& f : kept) {
        if (f->bytes == bytes) return f;
    }
    if (kept.size() >= max_kept_formats ||
        std::find(not_kept.begin(), not_kept.end(), bytes) != not_kept.end()) {
        return nullptr;
    }
    auto made = make_kept_format(bytes);
    if (!made) {
        if (not_kept.size() < 64) not_kept.push_back(bytes);
        return nullptr;
    }
    kept.push_back(std::make_shared<const kept_format>(std::move(*made)));
    return kept.back();
}

// Writes a filesystem of `bytes` into the empty, sized image at `image_fd`: the kept format's
// bytes, or mkfs.ext4 (owner uid:gid) when no format of that size can be kept.
void format_image(int image_fd, const std::string& image, std::uint64_t bytes, uid_t uid,
                  gid_t gid) {
    const auto format = kept_format_for(bytes);
    if (!format) {
        make_filesystem(image, image, uid, gid);
        return;
    }
    for (const auto& [offset, chunk] : format->data) {
        for (std::size_t done = 0; done < chunk.size();) {
            const ssize_t n = ::pwrite(image_fd, chunk.data() + done, chunk.size() - done,
                                       static_cast<off_t>(offset + done));
            if (n < 0 && errno == EINTR) continue;
            if (n <= 0) fail("cannot write " + image, n < 0 ? errno : EIO);
            done += static_cast<std::size_t>(n);
        }
    }
}

struct loop_device {
    unique_fd fd;  ///< keeps the device bound (autoclear) until the mount holds it
    std::string path;
};

// Binds a free loop device to `image_fd` with LO_FLAGS_AUTOCLEAR. No direct I/O: through the
// page cache, what the tenant wrote but the host has not yet flushed is simply dropped when
// the image is deleted.
loop_device attach_loop(int image_fd, const std::string& image) {
    const std::string what = "cannot attach a loop device for " + image;
    unique_fd control(::open("/dev/loop-control", O_RDWR | O_CLOEXEC));
    if (!control) fail(what, errno);
    loop_config config{};
    config.fd = static_cast<std::uint32_t>(image_fd);
    config.info.lo_flags = LO_FLAGS_AUTOCLEAR;
    std::memcpy(config.info.lo_file_name, image.data(),
                std::min<std::size_t>(image.size(), LO_NAME_SIZE - 1));

    int err = EBUSY;
    for (int attempt = 0; attempt < loop_attempts; ++attempt) {
        int number = ::ioctl(control.get(), LOOP_CTL_GET_FREE);
        if (number < 0) fail(what, errno);
        std::string path = "/dev/loop" + std::to_string(number);
        // Read-write: a loop device opened read-only is bound read-only.
        unique_fd device(::open(path.c_str(), O_RDWR | O_CLOEXEC));
        if (!device) {
            err = errno;
            if (err == ENOENT || err == ENXIO) continue;  // removed meanwhile
            break;
        }
        bool bound = ::ioctl(device.get(), LOOP_CONFIGURE, &config) == 0;
        err = bound ? 0 : errno;
        if (err == EINVAL || err == ENOTTY) {  // before Linux 5.8: two steps
            if (::ioctl(device.get(), LOOP_SET_FD, image_fd) != 0) {
                err = errno;
            } else if (::ioctl(device.get(), LOOP_SET_STATUS64, &config.info) != 0) {
                err = errno;
                ::ioctl(device.get(), LOOP_CLR_FD, 0);
            } else {
                bound = true;
            }
        }
        if (bound) {
            // Hold it read-only through the mount: a kernel built without
            // CONFIG_BLK_DEV_WRITE_MOUNTED refuses to mount a device open for writing.
            unique_fd holder(::open(path.c_str(), O_RDONLY | O_CLOEXEC));
            if (!holder) fail(what, errno);  // closing `device` unbinds it (autoclear)
            return {std::move(holder), std::move(path)};
        }
        if (err != EBUSY) break;  // EBUSY: someone else bound it first
    }
    fail(what, err);
}

// True when `path` is the root of a mount. statx's STATX_ATTR_MOUNT_ROOT (Linux 5.8) also
// sees a bind mount from the same filesystem, which comparing st_dev with the parent misses.
bool is_mountpoint(const fs::path& path) {
    struct statx here {};
    if (::statx(AT_FDCWD, path.c_str(), AT_SYMLINK_NOFOLLOW, STATX_TYPE, &here) != 0) {
        if (errno == ENOENT) return false;
        fail("cannot inspect " + path.string(), errno);
    }
    if ((here.stx_attributes_mask & STATX_ATTR_MOUNT_ROOT) != 0) {
        return (here.stx_attributes & STATX_ATTR_MOUNT_ROOT) != 0;
    }
    struct stat parent {};
    if (::stat(path.parent_path().c_str(), &parent) != 0) {
        fail("cannot inspect " + path.parent_path().string(), errno);
    }
    return makedev(here.stx_dev_major, here.stx_dev_minor) != parent.st_dev;
}

// Marks the filesystem at `workspace` shut down, so that unmounting it drops what the tenant
// left in the page cache instead of writing it through the loop device into an image about to
// be deleted: after the tenant wrote 500 MiB, unmounting took 3.3 s, and 60 ms shut down.
// Only when it is ext4 on a loop device backed by `image`: whatever else is mounted there
// (a bind mount of a host directory, say) is unmounted, never shut down. Best effort: if
// anything here fails, the unmount is merely slower.
void shut_down_disk(const fs::path& workspace, const fs::path& image) {
    unique_fd root(::open(workspace.c_str(), O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC));
    struct stat st {};
    struct statfs sfs {};
    if (!root || ::fstat(root.get(), &st) != 0 || ::fstatfs(root.get(), &sfs) != 0 ||
        sfs.f_type != EXT4_SUPER_MAGIC) {
        return;
    }
    const std::string sys = "/sys/dev/block/" + std::to_string(major(st.st_dev)) + ":" +
                            std::to_string(minor(st.st_dev)) + "/loop/backing_file";
    unique_fd backing(::open(sys.c_str(), O_RDONLY | O_CLOEXEC));
    char name[PATH_MAX + 2];
    ssize_t n = backing ? ::read(backing.get(), name, sizeof name) : -1;
    std::error_code ec;
    const fs::path canonical = fs::canonical(image, ec);  // as the kernel names it
    if (ec || n <= 0 ||
        std::string_view(name, static_cast<std::size_t>(n)) != canonical.string() + "\n") {
        return;
    }
    std::uint32_t flags = ext4_going_flags_nologflush;
    ::ioctl(root.get(), ext4_ioc_shutdown, &flags);
}

// Undoes a create_lease_disk that did not finish, in reverse order.
struct creation_undo {
    const fs::path& image;
    const fs::path& workspace;
    bool image_created = false;
    bool workspace_created = false;
    bool mounted = false;

    creation_undo(const fs::path& image_path, const fs::path& workspace_path)
        : image(image_path), workspace(workspace_path) {}
    creation_undo(const creation_undo&) = delete;
    creation_undo& operator=(const creation_undo&) = delete;
    creation_undo(creation_undo&&) = delete;
    creation_undo& operator=(creation_undo&&) = delete;

    ~creation_undo() {
        if (mounted) ::umount2(workspace.c_str(), MNT_DETACH | UMOUNT_NOFOLLOW);
        if (workspace_created) ::rmdir(workspace.c_str());
        if (image_created) ::unlink(image.c_str());
    }
};

}  // namespace

// The image and its mountpoint may live apart (the image in a directory that is root's alone,
// the mountpoint where the lease's uid can reach it by path). The forms of lease_disk.hpp
// keep both in one directory; these two take both paths and are otherwise the same.
void create_lease_disk(const fs::path& image, const fs::path& workspace, std::uint64_t bytes,
                       uid_t uid, gid_t gid) {
    bytes &= ~std::uint64_t{4095};
    if (bytes < min_disk_bytes || bytes > max_disk_bytes) {
        throw rpc_error(errc::provider_error, "a lease disk of " + std::to_string(bytes) +
                                                  " bytes is outside [8 MiB, 1 TiB]");
    }
    creation_undo undo(image, workspace);

    // O_EXCL is the "no disk yet" check: an existing disk is left exactly as it was.
    unique_fd image_fd(
        ::open(image.c_str(), O_RDWR | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC, 0600));
    if (!image_fd) {
        if (errno == EEXIST) {
            throw rpc_error(errc::provider_error,
                            image.parent_path().string() + " already holds a disk");
        }
        fail("cannot create " + image.string(), errno);
    }
    undo.image_created = true;
    if (::ftruncate(image_fd.get(), static_cast<off_t>(bytes)) != 0) {
        fail("cannot size " + image.string(), errno);
    }
    format_image(image_fd.get(), image.string(), bytes, uid, gid);

    loop_device loop = attach_loop(image_fd.get(), image.string());
    image_fd.reset();  // the loop device holds the file now
    if (::mkdir(workspace.c_str(), 0755) != 0) {
        fail("cannot create the mountpoint " + workspace.string(), errno);
    }
    undo.workspace_created = true;
    if (::mount(loop.path.c_str(), workspace.c_str(), "ext4", MS_NOSUID | MS_NODEV, nullptr) != 0) {
        fail("cannot mount " + loop.path + " at " + workspace.string(), errno);
    }
    undo.mounted = true;
    loop.fd.reset();  // the mount holds the device now; unmounting frees it (autoclear)

    // A kept format's root is root's (mkfs's root_owner did this where it ran, unless an
    // e2fsprogs ignored it): the tenant must not get a root-owned workspace.
    struct stat root {};
    if (::stat(workspace.c_str(), &root) != 0) fail("cannot inspect " + workspace.string(), errno);
    if (root.st_uid != uid || root.st_gid != gid || (root.st_mode & 07777) != 0755) {
        if (::chown(workspace.c_str(), uid, gid) != 0 || ::chmod(workspace.c_str(), 0755) != 0) {
            fail("cannot hand " + workspace.string() + " to " + std::to_string(uid), errno);
        }
    }
    undo.image_created = undo.workspace_created = undo.mounted = false;
}

fs::path create_lease_disk(const fs::path& dir, std::uint64_t bytes, uid_t uid, gid_t gid) {
    fs::path workspace = dir / workspace_name;
    create_lease_disk(dir / image_name, workspace, bytes, uid, gid);
    return workspace;
}

void destroy_lease_disk(const fs::path& image, const fs::path& workspace) {
    if (is_mountpoint(workspace)) shut_down_disk(workspace, image);
    // Lazily: a process still inside cannot block teardown. The kernel drops the filesystem,
    // and autoclear the loop device, once its last user goes, without our walking it.
    for (int layer = 0; is_mountpoint(workspace); ++layer) {
        if (layer == max_stacked_mounts) {
            throw rpc_error(errc::provider_error,
                            "cannot unmount " + workspace.string() + ": too many mounts on it");
        }
        if (::umount2(workspace.c_str(), MNT_DETACH | UMOUNT_NOFOLLOW) != 0 && errno != EINVAL) {
            fail("cannot unmount " + workspace.string(), errno);
        }
    }
    // The image goes even when the mountpoint cannot: it holds the space. A workspace that
    // is a plain directory with something in it (a lease without a disk) is left to the
    // caller's remove_tree_bounded.
    int rmdir_err = ::rmdir(workspace.c_str()) == 0 ? 0 : errno;
    if (::unlink(image.c_str()) != 0 && errno != ENOENT) {
        fail("cannot delete " + image.string(), errno);
    }
    if (rmdir_err != 0 && rmdir_err != ENOENT && rmdir_err != ENOTEMPTY && rmdir_err != EEXIST) {
        fail("cannot remove the mountpoint " + workspace.string(), rmdir_err);
    }
}

void destroy_lease_disk(const fs::path& dir) {
    destroy_lease_disk(dir / image_name, dir / workspace_name);
}

std::uint64_t disk_used_bytes(const fs::path& mountpoint) noexcept {
    struct statvfs st {};
    if (::statvfs(mountpoint.c_str(), &st) != 0) return 0;
    return static_cast<std::uint64_t>(st.f_blocks - st.f_bfree) * st.f_frsize;
}

std::uint64_t disk_used_bytes(int fd) noexcept {
    struct statvfs st {};
    if (::fstatvfs(fd, &st) != 0) return 0;
    return static_cast<std::uint64_t>(st.f_blocks - st.f_bfree) * st.f_frsize;
}

// posix_spawn cannot set a resource limit for the child, so util-linux's prlimit (essential
// on Debian) sets RLIMIT_AS on itself and then execs rm: the limit is in force before rm's
// first allocation, with no code of ours between clone and exec. (Setting it with prlimit(2)
// after posix_spawn returns would race with rm's start; a hand-made CLONE_VFORK child would
// redo what glibc's posix_spawn already does right.)
void remove_tree_bounded(const fs::path& path) {
    struct stat st {};
    if (::lstat(path.c_str(), &st) != 0) {
        if (errno == ENOENT) return;
        fail("cannot remove " + path.string(), errno);
    }
    // Root's CAP_DAC_OVERRIDE lets rm enter and empty directories whose mode forbids it
    // (0500, 000), so no chmod pass is needed first.
    tool_result result = run_tool({find_program({"/usr/bin/prlimit", "/bin/prlimit"}),
                                   "--as=" + std::to_string(rm_address_space), "--",
                                   find_program({"/usr/bin/rm", "/bin/rm"}), "-rf",
                                   "--one-file-system", "--", path.string()});
    if (::lstat(path.c_str(), &st) == 0 || errno != ENOENT) {
        throw rpc_error(errc::provider_error,
                        "cannot remove " + path.string() + ": rm: " + describe(result));
    }
}

}  // namespace sandboxd::detail
