#include "server/kept_output.hpp"

#include <sandboxd/core/errors.hpp>

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <stdexcept>
#include <string>
#include <system_error>
#include <utility>

namespace sandboxd {
namespace {

namespace fs = std::filesystem;

[[noreturn]] void fail(const std::string& what, int err) {
    const std::string why = err == ENOSPC ? "no room for the kept output" : std::strerror(err);
    throw rpc_error(errc::provider_error, "kept output: " + what + ": " + why);
}

/// pwrite(2) of all of `bytes` at `at` (a short write is continued).
void write_at(int fd, std::string_view bytes, std::uint64_t at) {
    while (!bytes.empty()) {
        const auto n = ::pwrite(fd, bytes.data(), bytes.size(), static_cast<off_t>(at));
        if (n < 0) {
            if (errno == EINTR) continue;
            fail("write", errno);
        }
        bytes.remove_prefix(static_cast<std::size_t>(n));
        at += static_cast<std::uint64_t>(n);
    }
}

/// pread(2) of all of `into` from `at` (the file is preallocated: a short read is an error).
void read_at(int fd, std::span<char> into, std::uint64_t at) {
    while (!into.empty()) {
        const auto n = ::pread(fd, into.data(), into.size(), static_cast<off_t>(at));
        if (n < 0) {
            if (errno == EINTR) continue;
            fail("read", errno);
        }
        if (n == 0) fail("read", EIO);
        into = into.subspan(static_cast<std::size_t>(n));
        at += static_cast<std::uint64_t>(n);
    }
}

unique_fd make_ring(const fs::path& path, std::uint64_t capacity) {
    unique_fd fd(::open(path.c_str(), O_RDWR | O_CREAT | O_EXCL | O_CLOEXEC | O_NOFOLLOW, 0600));
    if (!fd) fail("create " + path.string(), errno);
    // Allocated now, so the retention is charged at the open and a later write cannot fail
    // for room.
    if (const int err = ::posix_fallocate(fd.get(), 0, static_cast<off_t>(capacity)); err != 0) {
        fail("allocate " + std::to_string(capacity) + " bytes for " + path.string(), err);
    }
    return fd;
}

}  // namespace

KeptOutput::KeptOutput(fs::path dir, std::uint64_t capacity,
                       std::array<unique_fd, 2> files) noexcept
    : dir_(std::move(dir)), capacity_(capacity), files_(std::move(files)) {}

std::unique_ptr<KeptOutput> KeptOutput::create(const fs::path& dir, std::uint64_t capacity) {
    if (capacity < min_capacity || capacity > max_capacity) {
        throw std::invalid_argument("kept output: capacity " + std::to_string(capacity) +
                                    " is not in [4096, 1 GiB]");
    }
    if (::mkdir(dir.c_str(), 0700) != 0) fail("create " + dir.string(), errno);
    try {
        std::array<unique_fd, 2> files{make_ring(dir / "stdout", capacity),
                                       make_ring(dir / "stderr", capacity)};
        return std::unique_ptr<KeptOutput>(new KeptOutput(dir, capacity, std::move(files)));
    } catch (...) {
        std::error_code ec;
        fs::remove_all(dir, ec);  // nothing behind: the files made so far and the directory
        throw;
    }
}

void KeptOutput::append(output_stream stream, std::string_view bytes) {
    const auto i = index(stream);
    if (!files_[i]) throw std::logic_error("kept output: append with the files closed");
    auto& end = ends_[i];
    if (bytes.size() > capacity_) {  // only the last `capacity` bytes can be kept
        end += bytes.size() - capacity_;
        bytes = bytes.substr(bytes.size() - capacity_);
    }
    const auto at = end % capacity_;
    const auto first = std::min<std::uint64_t>(bytes.size(), capacity_ - at);
    write_at(files_[i].get(), bytes.substr(0, first), at);
    if (first < bytes.size()) write_at(files_[i].get(), bytes.substr(first), 0);
    end += bytes.size();
}

std::size_t KeptOutput::read(output_stream stream, std::uint64_t offset,
                             std::span<char> into) const {
    const auto i = index(stream);
    if (!files_[i]) throw std::logic_error("kept output: read with the files closed");
    if (offset < first_kept(stream) || offset > ends_[i]) {
        throw std::out_of_range("kept output: offset " + std::to_string(offset) + " is not in [" +
                                std::to_string(first_kept(stream)) + ", " +
                                std::to_string(ends_[i]) + "]");
    }
    const auto n =
        static_cast<std::size_t>(std::min<std::uint64_t>(into.size(), ends_[i] - offset));
    const auto at = offset % capacity_;
    const auto first = static_cast<std::size_t>(std::min<std::uint64_t>(n, capacity_ - at));
    read_at(files_[i].get(), into.first(first), at);
    if (first < n) read_at(files_[i].get(), into.subspan(first, n - first), 0);
    return n;
}

void KeptOutput::remove() noexcept {
    std::error_code ec;
    fs::remove(dir_ / "stdout", ec);
    fs::remove(dir_ / "stderr", ec);
    fs::remove(dir_, ec);
}

void KeptOutput::close_files() noexcept {
    for (auto& f : files_) f.reset();
}

void KeptOutput::reopen() {
    if (files_open()) return;
    std::array<unique_fd, 2> files;
    for (auto s : {output_stream::out, output_stream::err}) {
        const auto path = dir_ / (s == output_stream::err ? "stderr" : "stdout");
        files[index(s)] = unique_fd(::open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NOFOLLOW));
        if (!files[index(s)]) fail("open " + path.string(), errno);
    }
    files_ = std::move(files);
}

}  // namespace sandboxd
