#pragma once
/// @file lease_disk.hpp
/// A lease's workspace as a filesystem of its own, so that its size is enforced by the kernel
/// and its teardown costs the same whatever the tenant left in it. Internal to the provider.
///
/// Layout: `<dir>/disk.img` (a sparse file of exactly `bytes`), formatted ext4 by
/// `mkfs.ext4` (e2fsprogs) with its root directory owned by uid:gid mode 0755, attached to a
/// free loop device (LOOP_CTL_GET_FREE, LOOP_CONFIGURE with LO_FLAGS_AUTOCLEAR, falling back to
/// LOOP_SET_FD + LOOP_SET_STATUS64 on kernels before 5.8) and mounted at `<dir>/workspace`
/// with nosuid,nodev. A write past the size fails inside with ENOSPC. Unmounting frees the
/// loop device (autoclear); deleting the image frees the space.
///
/// Errors: rpc_error(errc::provider_error) naming the step and the errno text; a failed
/// create() leaves nothing behind (no mount, no loop device, no image).
/// Formatting: the first disk of each size (up to 4 sizes per process) is formatted by
/// mkfs.ext4 in a memfd and the bytes it wrote (about 140 KiB for 64 MiB) are kept; every later
/// disk of that size is those bytes written into a fresh sparse file, so its filesystem's UUID
/// and hash seed are those of the kept format (see lease_disk.cpp). Other sizes run mkfs.ext4
/// on the image itself.
///
/// Thread-safety: every function may be called from any thread; each blocks (create writes the
/// kept format, or runs mkfs.ext4, about 20 ms; destroy unmounts). Call off the I/O threads.

#include <sys/types.h>

#include <cstdint>
#include <filesystem>

namespace sandboxd::detail {

/// Smallest and largest disk a lease may have (mkfs.ext4 needs some room; 1 TiB is the sanity
/// cap of a sparse file).
inline constexpr std::uint64_t min_disk_bytes = 8ULL << 20;
inline constexpr std::uint64_t max_disk_bytes = 1ULL << 40;

/// Creates and mounts the disk described above; returns `<dir>/workspace`. `dir` must exist
/// (root-owned) and not hold a disk yet. `bytes` is rounded down to 4 KiB, in
/// [min_disk_bytes, max_disk_bytes]. Inode count: mkfs.ext4's default ratio (16 KiB per inode).
std::filesystem::path create_lease_disk(const std::filesystem::path& dir, std::uint64_t bytes,
                                        uid_t uid, gid_t gid);

/// The same with the image and the mount point named apart (the image among the daemon's
/// private records, the mount point where the lease's bubblewrap can reach it by path).
/// `workspace` is created (mode 0755, root) if missing; its parent must exist.
void create_lease_disk(const std::filesystem::path& image, const std::filesystem::path& workspace,
                       std::uint64_t bytes, uid_t uid, gid_t gid);

/// The same with the image and the mount point named apart. Removes `workspace` when it is an
/// empty directory after the unmount; a plain directory with contents (a lease without a disk)
/// is left for remove_tree_bounded().
void destroy_lease_disk(const std::filesystem::path& image, const std::filesystem::path& workspace);

/// Unmounts `<dir>/workspace` if mounted (lazily: MNT_DETACH, so a process still holding it
/// cannot block teardown) and deletes `<dir>/disk.img`. Idempotent: missing parts are fine.
/// Costs O(1) memory and descriptors whatever is inside the filesystem.
void destroy_lease_disk(const std::filesystem::path& dir);

/// Bytes in use on the filesystem mounted at `mountpoint` (statvfs: (blocks - bfree) * frsize).
/// 0 when it cannot be read. noexcept.
std::uint64_t disk_used_bytes(const std::filesystem::path& mountpoint) noexcept;
/// The same for the filesystem that descriptor `fd` is on (fstatvfs).
std::uint64_t disk_used_bytes(int fd) noexcept;

/// Removes the directory tree at `path` (not following symlinks, not crossing into other
/// filesystems) with memory and descriptors bounded whatever the tree's depth or size: the
/// walk runs in a child process (`rm -rf --one-file-system`, or an equivalent of ours) with
/// an address-space limit, and the daemon only waits for it. Used where a lease has no disk of
/// its own (limits not enforced). Missing path: success. Throws provider_error when the tree
/// remains.
void remove_tree_bounded(const std::filesystem::path& path);

}  // namespace sandboxd::detail
