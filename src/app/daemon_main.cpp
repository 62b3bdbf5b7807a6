#include <malloc.h>
#include <sys/stat.h>
#include <sandboxd/app/app.hpp>
#include <sandboxd/core/config.hpp>
#include <sandboxd/core/errors.hpp>
#include <sandboxd/core/logging.hpp>
#include <sandboxd/server/server.hpp>
#include <sandboxd/version.hpp>

#include <spdlog/spdlog.h>
#include <systemd/sd-daemon.h>
#include <boost/program_options.hpp>

#include <sys/resource.h>
#include <atomic>
#include <csignal>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <functional>
#include <iostream>
#include <thread>
#include <vector>

namespace sandboxd {
namespace po = boost::program_options;

namespace {

/// The bound `listen` address on the first line; the plainListen address, when there is
/// one, on the second.
void write_ready_file(const std::string& path, const std::string& address,
                      const std::string& plain) {
    const std::string tmp = path + ".tmp";
    {
        std::ofstream out(tmp, std::ios::trunc);
        out << address << "\n";
        if (!plain.empty()) out << plain << "\n";
        if (!out) throw std::runtime_error("cannot write ready file " + tmp);
    }
    std::filesystem::rename(tmp, path);
}

/// Files holding secrets that another user may read: one warning each (--check-config).
std::vector<std::string> readable_secret_files(const Config& c) {
    std::vector<std::pair<std::string, std::string>> files;  // field, path
    for (std::size_t i = 0; i < c.tokens.size(); ++i) {
        files.emplace_back("auth.tokens[" + std::to_string(i) + "].tokenFile",
                           c.tokens[i].token_file);
    }
    files.emplace_back("tls.keyFile", c.tls.key_file);
    files.emplace_back("routing.peerTls.keyFile", c.peer_tls.key_file);
    files.emplace_back("registry.tls.keyFile", c.registry.tls.key_file);
    files.emplace_back("registry.passwordFile", c.registry.password_file);
    std::vector<std::string> out;
    for (const auto& [field, path] : files) {
        struct stat st {};
        if (path.empty() || ::stat(path.c_str(), &st) != 0) continue;
        if ((st.st_mode & 077) != 0) {
            char mode[8];
            std::snprintf(mode, sizeof mode, "%04o", static_cast<unsigned>(st.st_mode & 07777));
            std::string warning = field;
            warning.append(": ").append(path).append(" has mode ").append(mode);
            warning += ": others can read this secret (chmod 600 it)";
            out.push_back(std::move(warning));
        }
    }
    return out;
}

/// The command line's options.
po::options_description daemon_options() {
    po::options_description opts("sandboxd options");
    opts.add_options()("config", po::value<std::string>(), "config file (JSON with comments)")(
        "listen", po::value<std::string>(), "HOST:PORT to serve on (port 0 picks a free port)")(
        "state-dir", po::value<std::string>(), "state directory (registry, tokens, workspaces)")(
        "node-id", po::value<std::string>(), "this node's id (default: the host name)")(
        "ready-file", po::value<std::string>(), "write HOST:PORT and a newline here once ready")(
        "log-level", po::value<std::string>(), "trace|debug|info|warn|error|critical|off")(
        "check-config", "validate the config, print the effective config, exit 0 or 2")(
        "print-default-config", "print the default config and exit")(
        "print-config-reference", "print every config key as a Markdown table and exit")(
        "version", "print the version and exit")("help", "print this help and exit");
    return opts;
}

/// The config file with the command line's flags on top: at start, and again on SIGHUP.
Config load_config(const po::variables_map& vm) {
    Config config;
    if (vm.count("config")) config = load_config_file(vm["config"].as<std::string>());
    if (vm.count("listen")) config.listen = vm["listen"].as<std::string>();
    if (vm.count("state-dir")) config.state_dir = vm["state-dir"].as<std::string>();
    if (vm.count("node-id")) config.node_id = vm["node-id"].as<std::string>();
    if (vm.count("log-level")) {
        // Same rule as the config file's log.level.
        config = parse_config([&] {
            auto j = config_to_json(config);
            j["log"]["level"] = vm["log-level"].as<std::string>();
            j["auth"]["tokens"] = nlohmann::json::array();
            return j.dump();
        }());
        if (vm.count("config")) {
            auto tokens = load_config_file(vm["config"].as<std::string>()).tokens;
            config.tokens = tokens;
        }
    }
    validate_config(config);
    return config;
}

/// The process's signals and limits: SIGTERM, SIGINT and SIGHUP blocked (returned, for the
/// thread that waits for them), SIGPIPE ignored, RLIMIT_NOFILE raised to its hard limit.
sigset_t take_process_signals() {
    // SIGTERM and SIGINT (stop) and SIGHUP (reload: tokens and TLS material, Daemon::reload)
    // are taken by a waiting thread; every other thread (and, reset at spawn, no child) has
    // them blocked.
    // SIGPIPE is ignored: a closed pipe is an EPIPE error.
    std::signal(SIGPIPE, SIG_IGN);
    // Every channel holds a few pipes and every connection a socket: use the whole allowance
    // the hard limit grants (systemd's default soft limit is 1024).
    if (rlimit lim{}; ::getrlimit(RLIMIT_NOFILE, &lim) == 0 && lim.rlim_cur < lim.rlim_max) {
        lim.rlim_cur = lim.rlim_max;
        ::setrlimit(RLIMIT_NOFILE, &lim);
    }
    sigset_t stop_signals;
    sigemptyset(&stop_signals);
    sigaddset(&stop_signals, SIGTERM);
    sigaddset(&stop_signals, SIGINT);
    sigaddset(&stop_signals, SIGHUP);
    pthread_sigmask(SIG_BLOCK, &stop_signals, nullptr);
    return stop_signals;
}

/// Under systemd: the watchdog's pings and STATUS= as the daemon's status changes.
void notify_systemd(Daemon& daemon) {
    // The watchdog: pinged from the io_context, so a wedged I/O loop stops the pings
    // and systemd restarts the daemon (WatchdogSec=). Twice per watchdog period.
    std::uint64_t watchdog_usec = 0;
    if (sd_watchdog_enabled(0, &watchdog_usec) > 0 && watchdog_usec >= 2000) {
        daemon.on_tick(std::chrono::milliseconds(watchdog_usec / 2000),
                       [] { sd_notify(0, "WATCHDOG=1"); });
    }
    // STATUS= when it changes, checked every second.
    daemon.on_tick(std::chrono::seconds(1), [&daemon, last = std::string()]() mutable {
        auto now = daemon.status();
        if (now == last) return;
        last = std::move(now);
        sd_notify(0, ("STATUS=" + last).c_str());
    });
}

/// The signal waiter's loop: SIGHUP reloads (`load`), the first SIGTERM or SIGINT drains then
/// stops, a second stops at once; ends once `finished` is set and a signal wakes it.
void wait_for_signals(Daemon& daemon, const std::function<Config()>& load,
                      const std::atomic<bool>& finished, sigset_t stop_signals) {
    int sig = 0;
    bool draining = false;
    for (;;) {
        sigwait(&stop_signals, &sig);
        if (finished) break;
        if (sig == SIGHUP) {
            spdlog::info("received SIGHUP: reloading tokens and certificates");
            sd_notify(0, "RELOADING=1");
            try {
                daemon.reload(load());
            } catch (const std::exception& e) {
                spdlog::error("reload failed, keeping the tokens and certificates in use: {}",
                              e.what());
            }
            sd_notify(0, "READY=1");
        } else if (!draining) {
            draining = true;
            spdlog::info("received signal {}: draining, then stopping (again to stop at once)",
                         sig);
            sd_notify(0, "STOPPING=1");
            daemon.drain_then_stop();
        } else {
            spdlog::info("received signal {} again: stopping now", sig);
            daemon.stop();
            break;
        }
    }
}

/// Runs the daemon until it stops: the process's exit code.
int run_daemon(const Config& config, const po::variables_map& vm,
               const std::function<Config()>& load) {
    const sigset_t stop_signals = take_process_signals();

    try {
        Daemon daemon(config);
        const std::string address = daemon.start();
        spdlog::info("listening on {}", address);
        if (vm.count("ready-file")) {
            write_ready_file(vm["ready-file"].as<std::string>(), address, daemon.plain_address());
        }
        sd_notify(0, "READY=1");
        if (std::getenv("NOTIFY_SOCKET") != nullptr) notify_systemd(daemon);
        // The first SIGTERM (or SIGINT) drains, then stops (limits.drainTimeoutMs); a second
        // one stops at once. `finished` ends the wait once run() has returned.
        std::atomic<bool> finished{false};
        std::thread waiter([&daemon, &load, &finished, stop_signals] {
            wait_for_signals(daemon, load, finished, stop_signals);
        });
        daemon.run();
        // run() returned because stop() completed; wake the waiter if it still waits.
        finished = true;
        if (waiter.joinable()) {
            // Not a kill: SIGTERM is blocked and in the waiter's sigwait() set, so this only
            // ends its wait.
            // NOLINTNEXTLINE(bugprone-bad-signal-to-kill-thread)
            pthread_kill(waiter.native_handle(), SIGTERM);
            waiter.join();
        }
        spdlog::info("stopped");
        return 0;
    } catch (const config_error& e) {
        spdlog::critical("{}", e.what());
        return 2;
    } catch (const std::exception& e) {
        spdlog::critical("cannot start: {}", e.what());
        return 1;
    }
}

}  // namespace

int daemon_main(int argc, char** argv) {
    // Everything the daemon creates (registry, tokens, sandbox records) is root's alone unless
    // it says otherwise: the leases' uids can traverse the state directory.
    ::umask(077);
    // Output and stdin frames are up to 256 KiB, allocated and freed thousands of times a
    // second while a channel streams. glibc would map each one afresh (mmap threshold) or give
    // the freed space back at once (trim threshold), and page-fault it in again for the next:
    // a third of the daemon's CPU in a 1 GiB stream (perf, issue 19). Kept in the heap instead;
    // what is freed above 64 MiB still goes back.
    ::mallopt(M_MMAP_THRESHOLD, 4 << 20);
    ::mallopt(M_TRIM_THRESHOLD, 64 << 20);
    const po::options_description opts = daemon_options();
    po::variables_map vm;
    try {
        po::store(po::command_line_parser(argc, argv).options(opts).run(), vm);
        po::notify(vm);
    } catch (const po::error& e) {
        std::cerr << "sandboxd: " << e.what() << "\nTry 'sandboxd --help'.\n";
        return 2;
    }
    if (vm.count("help")) {
        std::cout << "Usage: sandboxd [OPTIONS]\nLeases bubblewrap sandboxes to host servers and "
                     "runs commands in them over WebSocket duplex channels.\n\n"
                  << opts
                  << "\nDocs: docs/protocol.md (wire), config/sandboxd.jsonc (every key).\n";
        return 0;
    }
    if (vm.count("version")) {
        std::cout << "sandboxd " << version_string << "\n";
        return 0;
    }
    if (vm.count("print-default-config")) {
        std::cout << default_config_text();
        return 0;
    }
    if (vm.count("print-config-reference")) {
        std::cout << config_reference_markdown();
        return 0;
    }
    const auto load = [&vm] { return load_config(vm); };
    Config config;
    try {
        config = load();
    } catch (const config_error& e) {
        std::cerr << "sandboxd: " << e.what() << "\n";
        return 2;
    }
    if (vm.count("check-config")) {
        for (const auto& w : readable_secret_files(config))
            std::cerr << "sandboxd: warning: " << w << "\n";
        std::cout << config_to_json(config).dump(2) << "\n";
        return 0;
    }
    setup_logging(config.log_level, config.log_format);

    return run_daemon(config, vm, load);
}

}  // namespace sandboxd
