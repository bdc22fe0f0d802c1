// A scratch directory for tests that write files, removed at the end.
//
// It lives in the working directory, which ctest sets to the build tree: a
// real disk, where O_DIRECT works (/tmp may be tmpfs or ramfs on other
// machines). The process id keeps parallel test processes apart.
#pragma once

#include <unistd.h>

#include <filesystem>
#include <string>

namespace zcore::testing_support {

class ScratchDir {
 public:
  explicit ScratchDir(const std::string& prefix)
      : path_(std::filesystem::current_path() / (prefix + "-" + std::to_string(::getpid()))) {
    std::filesystem::create_directories(path_);
  }
  ~ScratchDir() { std::filesystem::remove_all(path_); }
  ScratchDir(const ScratchDir&) = delete;
  ScratchDir& operator=(const ScratchDir&) = delete;

  std::string file(const std::string& name) const { return (path_ / name).string(); }
  std::string dir() const { return path_.string(); }
  const std::filesystem::path& path() const { return path_; }

 private:
  std::filesystem::path path_;
};

}  // namespace zcore::testing_support
