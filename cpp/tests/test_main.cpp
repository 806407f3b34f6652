// Runs the C++ tests: all of them, or those named on the command line (`--list` prints the
// names). Each case prints "ok" or "FAILED" with its name, then a summary line. Shared by the
// core's unit tests and the nccl stand-in tests (tests/standin).
#include <cstdio>
#include <cstring>
#include <exception>
#include <string>
#include <vector>

#include "test.hpp"

namespace megart::test {

namespace {
int failures = 0;
}  // namespace

std::vector<Case>& registry() {
  static std::vector<Case> cases;
  return cases;
}

void fail(const char* file, int line, const std::string& what) {
  ++failures;
  std::fprintf(stderr, "  FAILED %s:%d: %s\n", file, line, what.c_str());
  std::fflush(stderr);
}

}  // namespace megart::test

int main(int argc, char** argv) {
  using megart::test::failures;
  int ran = 0, failed_cases = 0;
  for (const auto& c : megart::test::registry()) {
    if (argc > 1 && std::strcmp(argv[1], "--list") == 0) {
      std::printf("%s\n", c.name);
      continue;
    }
    bool wanted = argc == 1;
    for (int i = 1; i < argc; ++i) wanted = wanted || std::strcmp(argv[i], c.name) == 0;
    if (!wanted) continue;
    const int before = failures;
    try {
      c.body();
    } catch (const std::exception& e) {
      megart::test::fail(__FILE__, __LINE__, std::string("uncaught exception: ") + e.what());
    }
    ++ran;
    const bool ok = failures == before;
    failed_cases += ok ? 0 : 1;
    std::printf("%s %s\n", ok ? "ok    " : "FAILED", c.name);
    std::fflush(stdout);
  }
  if (argc > 1 && std::strcmp(argv[1], "--list") == 0) return 0;
  std::printf("%d tests, %d failed\n", ran, failed_cases);
  return failed_cases == 0 && ran > 0 ? 0 : 1;
}
