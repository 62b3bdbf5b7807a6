#pragma once
// The kept output of one detached channel (issue 46): the last `capacity` bytes of each of its
// output streams, with their absolute offsets (bytes since the command started writing to
// that stream), so that a host that reattaches can resume exactly where it stopped reading.
//
// Storage: one file per stream in a directory of its own. Absolute offset `o` is at file
// offset `o`, and the file's size is end(): what is older than the last `capacity` bytes is
// punched out (fallocate(2) PUNCH_HOLE, a page at a time), so the file is sparse and holds at
// most `capacity` bytes and a step more on disk. `capacity` bytes are reserved when it is made
// (FALLOC_FL_KEEP_SIZE) so that a full disk refuses the open rather than the first writes.
// Because the size is the offset, the kept output survives its daemon: a later process
// opens it again (open()) and finds every offset where it was. Bytes moved in from a pipe
// (splice_in, splice(2)) are in the file or still in the pipe, whenever the process is
// killed: none is lost between the two. The bytes live in those files and the page cache,
// never in the daemon's heap: holding a flooding channel's output costs the daemon one frame
// buffer, whatever `capacity` is.
//
// Errors: create() throws rpc_error(errc::provider_error) naming the step and the errno text
// (ENOSPC: "no room for the kept output"), and leaves nothing behind; open(), append(),
// splice_in(), read() and reopen() throw the same on an I/O error; read() with the files
// closed throws std::logic_error. Offsets before first_kept() or after end() are the caller's
// error: read() throws std::out_of_range for them.
//
// Blocking: every call is a pread/pwrite/splice/fallocate on a local file (page cache; may
// wait for writeback under memory pressure). Thread-safety: none; one owner (the channel's
// strand).
#include <sandboxd/core/unique_fd.hpp>
#include <sandboxd/provider/channel_backend.hpp>

#include <array>
#include <cstdint>
#include <filesystem>
#include <memory>
#include <span>
#include <string_view>

namespace sandboxd {

class KeptOutput {
public:
    /// Smallest and largest `capacity` per stream (one page; 1 GiB).
    static constexpr std::uint64_t min_capacity = 4096;
    static constexpr std::uint64_t max_capacity = 1ULL << 30;

    /// Makes `dir` (mode 0700; its parent must exist) with the files "stdout" and "stderr",
    /// each `capacity` bytes (in [min_capacity, max_capacity]; std::invalid_argument else).
    /// `dir` must not exist yet.
    static std::unique_ptr<KeptOutput> create(const std::filesystem::path& dir,
                                              std::uint64_t capacity);
    /// Opens the kept output that create() made in `dir` (an earlier process's), for
    /// appending, with `capacity` as it was made: every end() is the file's size.
    static std::unique_ptr<KeptOutput> open(const std::filesystem::path& dir,
                                            std::uint64_t capacity);
    ~KeptOutput() = default;
    KeptOutput(const KeptOutput&) = delete;
    KeptOutput& operator=(const KeptOutput&) = delete;

    /// Keeps `bytes` as the next bytes of `stream` (overwriting its oldest ones when the ring
    /// is full). Any size: more than `capacity` keeps the last `capacity` of them.
    void append(output_stream stream, std::string_view bytes);
    /// Moves exactly `count` bytes from `pipe_fd` (a pipe that holds at least that many, and
    /// that nobody else reads meanwhile) to the end of `stream`, with splice(2): no byte is
    /// ever only in this process. On an error the bytes moved so far are kept, and it throws.
    void splice_in(output_stream stream, int pipe_fd, std::size_t count);
    /// Copies kept bytes of `stream` from absolute `offset` (first_kept() <= offset <= end())
    /// into `into`; returns how many (min(into.size(), end() - offset)).
    std::size_t read(output_stream stream, std::uint64_t offset, std::span<char> into) const;

    /// Bytes written to `stream` so far: the offset of the next byte.
    [[nodiscard]] std::uint64_t end(output_stream stream) const noexcept {
        return ends_[index(stream)];
    }
    /// The offset of the oldest byte still kept (end() - capacity, or 0).
    [[nodiscard]] std::uint64_t first_kept(output_stream stream) const noexcept {
        const auto e = end(stream);
        return e > capacity_ ? e - capacity_ : 0;
    }
    [[nodiscard]] std::uint64_t capacity() const noexcept { return capacity_; }
    [[nodiscard]] const std::filesystem::path& dir() const noexcept { return dir_; }

    /// Deletes the files and the directory (the open descriptors stay valid until destroyed
    /// or closed). noexcept: what cannot be removed is left.
    void remove() noexcept;

    /// Closes the two files (the command ended and nobody reads: an ended channel kept for
    /// hours holds no descriptor). append() may not be called after; read() needs reopen().
    void close_files() noexcept;
    /// Opens the files again by path, for reading (after close_files(); nothing when open).
    /// Throws rpc_error(errc::provider_error) naming the file and the errno text when one is
    /// gone or cannot be opened, and then leaves them closed.
    void reopen();
    [[nodiscard]] bool files_open() const noexcept { return static_cast<bool>(files_[0]); }

private:
    KeptOutput(std::filesystem::path dir, std::uint64_t capacity,
               std::array<unique_fd, 2> files) noexcept;
    static std::size_t index(output_stream s) noexcept { return s == output_stream::err ? 1 : 0; }

    std::filesystem::path dir_;
    std::uint64_t capacity_;
    std::array<unique_fd, 2> files_;
    /// Punches out what is older than the last `capacity` bytes of `stream`, a step at a
    /// time (best effort: a filesystem without hole punching keeps it).
    void trim(std::size_t i) noexcept;

    std::array<std::uint64_t, 2> ends_{0, 0};
    std::array<std::uint64_t, 2> punched_{0, 0};  ///< below this, the file is a hole
};

}  // namespace sandboxd
