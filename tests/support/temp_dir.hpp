#pragma once
// A fresh directory under /tmp for one test, removed with everything in it on destruction.
#include <cstdlib>
#include <filesystem>
#include <stdexcept>
#include <string>
#include <system_error>

namespace sandboxd::test {

class TempDir {
public:
    /// `prefix` names the test in the directory's name (/tmp/<prefix>-XXXXXX). Throws
    /// std::runtime_error when the directory cannot be made.
    explicit TempDir(const std::string& prefix = "sandboxd-test") {
        std::string tmpl = "/tmp/" + prefix + "-XXXXXX";
        if (mkdtemp(tmpl.data()) == nullptr) throw std::runtime_error("mkdtemp failed");
        path_ = tmpl;
    }
    TempDir(const TempDir&) = delete;
    TempDir& operator=(const TempDir&) = delete;
    ~TempDir() {
        std::error_code ec;
        std::filesystem::remove_all(path_, ec);
    }
    const std::filesystem::path& path() const noexcept { return path_; }
    std::string file(const std::string& name) const { return (path_ / name).string(); }

private:
    std::filesystem::path path_;
};

}  // namespace sandboxd::test
