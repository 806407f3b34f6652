// A minimal test harness: TEST registers a function, CHECK records a failure with its place.
#pragma once

#include <functional>
#include <sstream>
#include <string>
#include <vector>

namespace megart::test {

struct Case {
  const char* name;
  std::function<void()> body;
};
std::vector<Case>& registry();
void fail(const char* file, int line, const std::string& what);

struct Register {
  Register(const char* name, std::function<void()> body) { registry().push_back({name, body}); }
};

}  // namespace megart::test

#define MEGART_CONCAT2(a, b) a##b
#define MEGART_CONCAT(a, b) MEGART_CONCAT2(a, b)
#define TEST(name)                                                             \
  static void name();                                                          \
  static ::megart::test::Register MEGART_CONCAT(register_, name)(#name, name); \
  static void name()

#define CHECK(cond)                                                            \
  do {                                                                         \
    if (!(cond)) ::megart::test::fail(__FILE__, __LINE__, "CHECK(" #cond ")"); \
  } while (0)

#define CHECK_EQ(a, b)                                             \
  do {                                                             \
    const auto& va_ = (a);                                         \
    const auto& vb_ = (b);                                         \
    if (!(va_ == vb_)) {                                           \
      std::ostringstream os_;                                      \
      os_ << "CHECK_EQ(" #a ", " #b "): " << va_ << " != " << vb_; \
      ::megart::test::fail(__FILE__, __LINE__, os_.str());         \
    }                                                              \
  } while (0)

// Checks that `stmt` throws `type` and that its message contains `needle`.
#define CHECK_THROWS(type, stmt, needle)                                                     \
  do {                                                                                       \
    bool thrown_ = false;                                                                    \
    try {                                                                                    \
      stmt;                                                                                  \
    } catch (const type& e_) {                                                               \
      thrown_ = true;                                                                        \
      if (std::string(e_.what()).find(needle) == std::string::npos) {                        \
        ::megart::test::fail(__FILE__, __LINE__,                                             \
                             std::string("message lacks '") + (needle) + "': " + e_.what()); \
      }                                                                                      \
    }                                                                                        \
    if (!thrown_) ::megart::test::fail(__FILE__, __LINE__, #stmt " did not throw " #type);   \
  } while (0)
