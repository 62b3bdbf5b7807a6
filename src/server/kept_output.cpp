#include "server/kept_output.hpp"

#include <sandboxd/core/errors.hpp>

#include <fcntl.h>
#include <linux/falloc.h>
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

/// pread(2) of all of `into` from `at` (below the file's size: a short read is an error).
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

unique_fd make_stream_file(const fs::path& path, std::uint64_t capacity) {
    unique_fd fd(::open(path.c_str(), O_RDWR | O_CREAT | O_EXCL | O_CLOEXEC | O_NOFOLLOW, 0600));
    if (!fd) fail("create " + path.string(), errno);
    // Reserved now, so the retention is charged at the open (the size stays 0: it is the
    // offset). A filesystem that cannot reserve (EOPNOTSUPP) writes as it goes.
    if (::fallocate(fd.get(), FALLOC_FL_KEEP_SIZE, 0, static_cast<off_t>(capacity)) != 0 &&
        errno != EOPNOTSUPP) {
        fail("allocate " + std::to_string(capacity) + " bytes for " + path.string(), errno);
    }
    return fd;
}

/// How far behind the kept window a stream's file is punched at once: a page at least, an
/// eighth of the capacity at most, so that a stream costs a punch per eighth of its capacity.
std::uint64_t punch_step(std::uint64_t capacity) {
    return std::max<std::uint64_t>(4096, (capacity / 8) & ~std::uint64_t{4095});
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
        std::array<unique_fd, 2> files{make_stream_file(dir / "stdout", capacity),
                                       make_stream_file(dir / "stderr", capacity)};
        return std::unique_ptr<KeptOutput>(new KeptOutput(dir, capacity, std::move(files)));
    } catch (...) {
        std::error_code ec;
        fs::remove_all(dir, ec);  // nothing behind: the files made so far and the directory
        throw;
    }
}

std::unique_ptr<KeptOutput> KeptOutput::open(const fs::path& dir, std::uint64_t capacity) {
    if (capacity < min_capacity || capacity > max_capacity) {
        throw std::invalid_argument("kept output: capacity " + std::to_string(capacity) +
                                    " is not in [4096, 1 GiB]");
    }
    std::array<unique_fd, 2> files;
    std::array<std::uint64_t, 2> ends{0, 0};
    for (auto s : {output_stream::out, output_stream::err}) {
        const auto path = dir / (s == output_stream::err ? "stderr" : "stdout");
        unique_fd fd(::open(path.c_str(), O_RDWR | O_CLOEXEC | O_NOFOLLOW));
        struct stat st {};
        if (!fd || ::fstat(fd.get(), &st) != 0) fail("open " + path.string(), errno);
        ends[index(s)] = static_cast<std::uint64_t>(st.st_size);
        files[index(s)] = std::move(fd);
    }
    auto kept = std::unique_ptr<KeptOutput>(new KeptOutput(dir, capacity, std::move(files)));
    kept->ends_ = ends;
    for (std::size_t i = 0; i < 2; ++i) kept->trim(i);
    return kept;
}

void KeptOutput::append(output_stream stream, std::string_view bytes) {
    const auto i = index(stream);
    if (!files_[i]) throw std::logic_error("kept output: append with the files closed");
    auto& end = ends_[i];
    std::uint64_t at = end;
    if (bytes.size() > capacity_) {  // only the last `capacity` bytes can be kept
        at += bytes.size() - capacity_;
        bytes = bytes.substr(bytes.size() - capacity_);
    }
    write_at(files_[i].get(), bytes, at);
    end = at + bytes.size();
    trim(i);
}

void KeptOutput::splice_in(output_stream stream, int pipe_fd, std::size_t count) {
    const auto i = index(stream);
    if (!files_[i]) throw std::logic_error("kept output: splice with the files closed");
    while (count > 0) {
        auto at = static_cast<loff_t>(ends_[i]);
        const ssize_t n = ::splice(pipe_fd, nullptr, files_[i].get(), &at, count, 0);
        if (n < 0 && errno == EINTR) continue;
        if (n <= 0) fail("move output in", n == 0 ? EPIPE : errno);
        ends_[i] += static_cast<std::uint64_t>(n);
        count -= static_cast<std::size_t>(n);
    }
    trim(i);
}

void KeptOutput::trim(std::size_t i) noexcept {
    if (!files_[i] || ends_[i] <= capacity_) return;
    const std::uint64_t below = (ends_[i] - capacity_) & ~std::uint64_t{4095};
    if (below < punched_[i] + punch_step(capacity_)) return;
    // Best effort: a filesystem that cannot punch keeps the old bytes (and is not asked
    // again for them).
    (void)::fallocate(files_[i].get(), FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE,
                      static_cast<off_t>(punched_[i]), static_cast<off_t>(below - punched_[i]));
    punched_[i] = below;
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
    read_at(files_[i].get(), into.first(n), offset);
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
