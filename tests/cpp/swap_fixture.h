// The fixture of the swap tests (test_swap_manager.cpp, test_swap_file.cpp):
// a scratch directory to swap into, configurations for it, files to leave
// in it, and random bytes to swap.
#pragma once

#include <gtest/gtest.h>

#include <cstdint>
#include <filesystem>
#include <fstream>
#include <random>
#include <string>
#include <vector>

#include "scratch_dir.h"
#include "zcore/swap_manager.h"

namespace zcore::testing_support {

class SwapTest : public ::testing::Test {
 protected:
  SwapTest() : scratch_("swap-test"), dir_(scratch_.path()) {}

  SwapConfig config(std::int64_t capacity) const {
    SwapConfig c;
    c.directory = dir_.string();
    c.rank = 3;
    c.capacity = capacity;
    c.io.block_size = 64 << 10;
    c.io.queue_depth = 8;
    return c;
  }

  SwapConfig named(const std::string& name) const {
    SwapConfig c = config(1 << 20);
    c.name = name;
    return c;
  }

  // A file of `bytes` bytes in the scratch directory; returns its path.
  std::string write_file(const std::string& name, std::size_t bytes) const {
    const std::string path = (dir_ / name).string();
    std::ofstream f(path, std::ios::binary);
    const std::vector<char> content(bytes, 3);
    f.write(content.data(), static_cast<std::streamsize>(content.size()));
    return path;
  }

  static std::vector<unsigned char> random_bytes(std::size_t n, unsigned seed) {
    std::mt19937 rng(seed);
    std::vector<unsigned char> v(n);
    for (auto& b : v) b = static_cast<unsigned char>(rng());
    return v;
  }

  ScratchDir scratch_;
  std::filesystem::path dir_;
};

}  // namespace zcore::testing_support
