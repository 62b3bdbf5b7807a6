#pragma once
// The sink of a detached channel (issue 46): it stands between the Channel and whichever host
// connection is attached now, if any, so that the command never waits for an absent host and
// a host that comes back resumes exactly where it stopped reading.
//
// The Channel sends its frames here as it would to a connection. Each data frame's payload is
// appended to the channel's KeptOutput. With no host attached it is credited back to the
// channel at once (the command is never blocked by an absent host; past the kept capacity the
// oldest bytes go); while a host is attached, as that host is sent bytes, so that the command
// goes at the host's pace as an undetached one does (a host attached at the end of the kept
// output loses nothing when retainBytes is at least the channel's outputWindow). The
// exit notification is kept. An attachment (a host connection's sink and its channel id
// there) is a cursor per stream: it is sent the kept bytes from its offsets while it has
// credit (its own output window), first a duplexChannel.gap {channel, stream, firstKept} when
// bytes it asked for are no longer kept, and the exit once, after its last byte. A new
// attachment replaces the previous one, which is sent nothing more.
//
// Threading: everything on the channel's strand; the attached sink must be on the same
// strand. Frames are encoded binary only (dataEncoding base64 is not kept). Live output to an
// attachment that has caught up is forwarded as it came (one write to the kept output, no read
// back); an attachment behind is sent from the kept output.
//
// Descriptors: the kept output's two files are open while the command runs and while a host
// is attached; an ended channel that nobody reads holds none (attach() opens them again).
#include "server/channel.hpp"
#include "server/kept_output.hpp"

#include <nlohmann/json.hpp>

#include <array>
#include <chrono>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>

namespace sandboxd {

class DetachedOutput final : public ChannelSink,
                             public std::enable_shared_from_this<DetachedOutput> {
public:
    DetachedOutput(strand_t strand, std::unique_ptr<KeptOutput> kept);

    /// The channel whose sink this is (after the Channel is made with it): credit goes back
    /// to it.
    void bind(std::weak_ptr<Channel> channel) { channel_ = std::move(channel); }

    /// Where an attachment starts on each stream.
    struct Offsets {
        std::uint64_t stdout_offset = 0;
        std::uint64_t stderr_offset = 0;
    };
    /// What attach() gives: where the attachment starts, and its id for detach().
    struct AttachResult {
        Offsets from;
        std::uint64_t id = 0;
    };
    /// Attaches `sink` as channel `channel_id` with `output_window` bytes of credit, from
    /// `from` (nullopt: the oldest kept bytes). Returns the offsets it starts from (an offset
    /// past the end is taken as the end). With another host attached, throws
    /// rpc_error(errc::channel_attached) and changes nothing, unless `takeover`: then the
    /// previous attachment is sent duplexChannel.exit with outcome "takenOver" (its last
    /// message; the command goes on) and ends. Held (`hold`), the attachment is sent nothing
    /// until release(): the host's result goes first. The kept bytes follow on the next turns
    /// of the strand, never inside this call. When the kept files cannot be opened again (an
    /// ended channel), throws rpc_error(errc::provider_error) and changes nothing.
    AttachResult attach(std::weak_ptr<ChannelSink> sink, std::uint32_t channel_id,
                        std::uint32_t output_window, std::optional<Offsets> from,
                        bool takeover = false, bool hold = false);
    /// Lets held attachment `id` be sent to (see attach); nothing when it is no longer the
    /// current one.
    void release(std::uint64_t id);
    /// Ends attachment `id` (its connection went), if it is still the current one: the
    /// command goes on, its output is kept.
    void detach(std::uint64_t id) noexcept;
    /// Output credit from the attached host.
    void add_credit(std::uint32_t bytes);
    /// detach.hangupAfterMs: once no host has been attached for `after` while the command
    /// runs, the channel is hung up (Channel::hangup with its sink kept: SIGHUP, SIGKILL after
    /// the hangup grace, the exit kept with outcome transportClosed). Counted from each
    /// moment the last attachment ends; an attach stops the count. Call before the first
    /// attach.
    void hang_up_when_idle(std::chrono::milliseconds after) { idle_after_ = after; }
    /// Starts the hangupAfterMs count with nobody attached (a channel kept across a restart:
    /// its host has to attach again). On the strand.
    void start_unattached() noexcept { arm_idle_hangup(); }

    [[nodiscard]] bool attached() const noexcept { return attachment_.has_value(); }
    /// The kept exit notification's params (null while the command runs).
    [[nodiscard]] const nlohmann::json& exit() const noexcept { return exit_; }
    [[nodiscard]] const KeptOutput& kept() const noexcept { return *kept_; }
    /// Deletes the kept output's files (an open that failed); the descriptors stay valid.
    void remove_kept() noexcept { kept_->remove(); }

    /// The channel was kept across a daemon restart (issue 47): its exit is written to
    /// `<kept dir>/exit.json` when it comes, so that a later process finds it ended. Call
    /// before the channel starts.
    void persist_exit() { persist_exit_ = true; }
    /// An exit kept by an earlier process (exit.json): the channel has ended.
    void restore_exit(nlohmann::json exit);

    // ChannelSink: what the Channel sends.
    void send_binary(std::string frame) override;
    /// A pipe's bytes go straight into the kept output (KeptOutput::splice_in): never only in
    /// this process, so that a daemon killed at any instant loses none of them.
    bool can_splice() override { return kept_->files_open() && !finished_; }
    void send_spliced(std::string head, int pipe_fd, std::size_t count,
                      std::function<void(bool written)> done) override;
    void send_text(std::string text) override;
    void channel_finished(std::uint32_t channel) override;

private:
    struct Attachment {
        std::weak_ptr<ChannelSink> sink;
        std::uint32_t channel_id = 0;
        std::uint32_t window = 0;
        std::uint64_t unacked = 0;
        std::array<std::uint64_t, 2> cursor{0, 0};
        bool exit_sent = false;
        bool waiting_room = false;
        bool scheduled = false;
        bool held = false;
    };
    /// Sends the attachment what it may have now, on the next turn of the strand.
    void schedule();
    void send_to_attachment();
    void drop_attachment() noexcept;
    /// drop_attachment(), and the kept files closed when the command has ended.
    void let_go() noexcept;
    /// Starts the hangupAfterMs count (nobody is attached and the command runs).
    void arm_idle_hangup() noexcept;
    /// The attachment was sent `n` bytes: as much withheld credit goes back to the channel.
    void sent(std::uint64_t n);
    /// `n` bytes were kept: withheld while a host is attached, else credited back at once.
    void kept_bytes(std::uint32_t n);
    /// Tells the current attachment that another host took the channel over, and drops it.
    void end_taken_over();
    /// Sends the current attachment its last message: an exit with `outcome` (and `error`).
    void end_attachment(const char* outcome, nlohmann::json error = nullptr);
    /// Live output: the frame just kept (its `n` bytes at offset `at`) goes on as it came, its
    /// channel id rewritten, when the attachment has read everything before it and has room
    /// for it: no read back from the kept output. False when the frame must wait (schedule()).
    bool forward_live(output_stream stream, std::uint64_t at, std::string& frame, std::uint32_t n);
    /// One data frame of `stream` from the attachment's cursor; false when nothing was sent.
    bool send_kept(Attachment& a, ChannelSink& sink, output_stream stream);

    strand_t strand_;
    std::unique_ptr<KeptOutput> kept_;
    std::weak_ptr<Channel> channel_;
    std::optional<Attachment> attachment_;
    std::uint64_t generation_ = 0;  ///< bumped per attachment: stale wakes do nothing
    /// Output credit not yet given back to the channel: while a host is attached, the command
    /// goes at its pace (at most the channel's outputWindow ahead of what the host was sent).
    std::uint64_t withheld_ = 0;
    nlohmann::json exit_;
    bool finished_ = false;
    bool persist_exit_ = false;
    std::optional<std::chrono::milliseconds> idle_after_;
    std::unique_ptr<net::steady_timer> idle_timer_;  ///< made on the first arm
};

}  // namespace sandboxd
