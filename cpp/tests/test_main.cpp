#include <cstdio>
#include <exception>

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
}

}  // namespace megart::test

int main() {
  using megart::test::failures;
  int failed_cases = 0;
  for (const auto& c : megart::test::registry()) {
    const int before = failures;
    try {
      c.body();
    } catch (const std::exception& e) {
      megart::test::fail(__FILE__, __LINE__, std::string("uncaught exception: ") + e.what());
    }
    const bool ok = failures == before;
    failed_cases += ok ? 0 : 1;
    std::printf("%s %s\n", ok ? "ok    " : "FAILED", c.name);
  }
  std::printf("%zu tests, %d failed\n", megart::test::registry().size(), failed_cases);
  return failed_cases == 0 ? 0 : 1;
}
