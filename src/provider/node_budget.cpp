/// @file node_budget.cpp
#include "provider/node_budget.hpp"

#include <sandboxd/core/errors.hpp>

#include <algorithm>
#include <charconv>
#include <fstream>
#include <limits>
#include <stdexcept>
#include <string_view>

namespace sandboxd::detail {
namespace {

std::uint64_t read_number(const std::filesystem::path& path) {
    std::ifstream in(path);
    std::string text;
    if (!in || !std::getline(in, text)) {
        throw std::runtime_error("cannot read " + path.string() +
                                 " (the node's budgets are "
                                 "derived from it)");
    }
    std::uint64_t v = 0;
    const auto [end, err] = std::from_chars(text.data(), text.data() + text.size(), v);
    if (err != std::errc() || v == 0) {
        throw std::runtime_error(path.string() + ": not a positive number: \"" +
                                 text.substr(0, 40) + "\"");
    }
    return v;
}

std::uint64_t saturating_mul(std::uint64_t a, std::uint64_t b) {
    if (a != 0 && b > std::numeric_limits<std::uint64_t>::max() / a) {
        return std::numeric_limits<std::uint64_t>::max();
    }
    return a * b;
}

/// An eighth of `total`, at least `floor`, never all of it.
std::uint64_t reserve_of(std::uint64_t total, std::uint64_t floor) {
    return std::min(std::max(total / 8, floor), total - 1);
}

}  // namespace

std::unique_ptr<NodeBudget> NodeBudget::read_host(const std::filesystem::path& proc_sys,
                                                  std::uint32_t overcommit) {
    return std::make_unique<NodeBudget>(read_number(proc_sys / "kernel" / "pid_max"),
                                        read_number(proc_sys / "fs" / "file-max"), overcommit);
}

NodeBudget::NodeBudget(std::uint64_t pid_max, std::uint64_t file_max, std::uint32_t overcommit)
    : pid_max_(std::max<std::uint64_t>(pid_max, 2)),
      file_max_(std::max<std::uint64_t>(file_max, 2)),
      pid_reserve_(reserve_of(pid_max_, 1024)),
      file_reserve_(reserve_of(file_max_, 65536)),
      overcommit_(std::max<std::uint32_t>(overcommit, 1)),
      pids_limit_(saturating_mul(pid_max_ - pid_reserve_, overcommit_)),
      files_limit_(saturating_mul(file_max_ - file_reserve_, overcommit_)) {}

void NodeBudget::take(const BudgetShare& share) {
    std::lock_guard lock(mutex_);
    auto refuse = [this](const char* limit, const char* what, std::uint64_t held,
                         std::uint64_t asked, std::uint64_t budget, const char* source,
                         std::uint64_t host, std::uint64_t reserve) {
        throw rpc_error(errc::channel_limit,
                        std::string("this node's ") + what + " budget is full: its leases hold " +
                            std::to_string(held) + " of " + std::to_string(budget) + " (" + source +
                            " " + std::to_string(host) + " less " + std::to_string(reserve) +
                            " kept for the host, times overcommit " + std::to_string(overcommit_) +
                            ") and this lease asks for " + std::to_string(asked),
                        {{"limit", limit}});
    };
    if (share.pids > pids_limit_ - std::min(held_.pids, pids_limit_)) {
        refuse("nodePids", "pids", held_.pids, share.pids, pids_limit_, "kernel.pid_max", pid_max_,
               pid_reserve_);
    }
    if (share.open_files > files_limit_ - std::min(held_.open_files, files_limit_)) {
        refuse("nodeOpenFiles", "open-file", held_.open_files, share.open_files, files_limit_,
               "fs.file-max", file_max_, file_reserve_);
    }
    held_.pids += share.pids;
    held_.open_files += share.open_files;
}

void NodeBudget::give_back(const BudgetShare& share) noexcept {
    std::lock_guard lock(mutex_);
    held_.pids -= std::min(held_.pids, share.pids);
    held_.open_files -= std::min(held_.open_files, share.open_files);
}

std::string NodeBudget::describe() const {
    return "pids " + std::to_string(pids_limit_) + " (kernel.pid_max " + std::to_string(pid_max_) +
           " less " + std::to_string(pid_reserve_) + " for the host, times overcommit " +
           std::to_string(overcommit_) + "), open files " + std::to_string(files_limit_) +
           " (fs.file-max " + std::to_string(file_max_) + " less " + std::to_string(file_reserve_) +
           ", times " + std::to_string(overcommit_) + ")";
}

BudgetShare NodeBudget::held() const {
    std::lock_guard lock(mutex_);
    return held_;
}

}  // namespace sandboxd::detail
