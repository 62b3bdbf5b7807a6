#pragma once
// A real sandboxd process on 127.0.0.1:0 with its own temporary state directory, for the
// integration tests. Not thread-safe; one per test.
#include <sandboxd/client.hpp>

#include <sys/types.h>

#include <chrono>
#include <filesystem>
#include <memory>
#include <string>
#include <vector>

namespace sandboxd::test {

/// A directory under $TMPDIR removed (recursively) on destruction.
class TempDir {
public:
    TempDir();
    ~TempDir();
    TempDir(const TempDir&) = delete;
    TempDir& operator=(const TempDir&) = delete;
    const std::filesystem::path& path() const { return path_; }

private:
    std::filesystem::path path_;
};

class DaemonProcess {
public:
    /// Starts the daemon and waits (at most 30 s) for its ready file. `config_json` is written
    /// to a file and passed with --config when not empty.
    explicit DaemonProcess(std::string node_id = "node-a", std::string config_json = "",
                           std::vector<std::string> extra_args = {});
    ~DaemonProcess();
    DaemonProcess(const DaemonProcess&) = delete;
    DaemonProcess& operator=(const DaemonProcess&) = delete;

    /// SIGTERM and wait (SIGKILL after 20 s); returns the exit status (-1 if killed).
    int stop();
    /// SIGKILL and reap.
    void kill9();
    /// Starts it again on the same state directory (and a new port).
    void restart();

    pid_t pid() const { return pid_; }
    const std::string& address() const { return address_; }
    std::string url() const { return "ws://" + address_ + "/v1/ws"; }
    std::string token() const;
    const std::filesystem::path& state_dir() const { return state_dir_; }
    std::string log() const;
    std::unique_ptr<Client> connect() const { return std::make_unique<Client>(url(), token()); }
    /// PIDs of the daemon's direct children (bubblewrap processes of running channels).
    std::vector<pid_t> children() const;

private:
    void launch();
    std::string node_id_;
    std::string config_json_;
    std::vector<std::string> extra_args_;
    TempDir dir_;
    std::filesystem::path state_dir_;
    pid_t pid_ = -1;
    std::string address_;
};

/// Waits until `pred` holds or `timeout` passes; returns whether it held.
template <typename Pred>
bool eventually(Pred pred, std::chrono::milliseconds timeout);

/// Number of host processes whose command line starts with `needle`.
int count_processes_with(const std::string& needle);

/// The `lease` object of a duplexChannelOpen for `lease` (as returned by leaseAcquire).
nlohmann::json lease_ref(const nlohmann::json& lease);

/// Open params running `argv` on `lease`.
nlohmann::json open_params(const nlohmann::json& lease, std::vector<std::string> argv);

}  // namespace sandboxd::test

#include "support/daemon_fixture_impl.hpp"
