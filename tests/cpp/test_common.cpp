// GoogleTests of the machinery every capability shares (csrc/torch_ext/common/): the JSON reader,
// SHA-256, enum name tables, the at-fork registry and bounded waits.
#include <gtest/gtest.h>

#include <array>
#include <chrono>
#include <cmath>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <mutex>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include <c10/util/Exception.h>

#include "torch_ext/common/enum_names.h"
#include "torch_ext/common/fork.h"
#include "torch_ext/common/json.h"
#include "torch_ext/common/sha256.h"
#include "torch_ext/common/wait.h"
#include "reliability_helpers.h"

namespace {

using torch_ext::testing::expect_error;

enum class Colour { red, green, blue };

}  // namespace

template <>
struct torch_ext::EnumNames<Colour> {
  static constexpr std::string_view owner = "Palette", what = "colour";
  static constexpr std::array<std::pair<Colour, std::string_view>, 3> names{
      {{Colour::red, "red"}, {Colour::green, "green"}, {Colour::blue, "blue"}}};
};

TEST(CommonJson, ParsesObjectsArraysStringsIntegers) {
  const auto doc = torch_ext::parse_json(R"( {"a": [1, -2, 9223372036854775807], "s": "x\"\u00e9\ud83d\ude00", "t": true} )", "j");
  const auto v = doc.root();
  ASSERT_EQ(v.kind(), torch_ext::JsonValue::Kind::Object);
  EXPECT_EQ(v.size(), 3);
  EXPECT_EQ(v.find("a")->elements()[2].integer(), INT64_MAX);
  EXPECT_EQ(v.find("a")->elements()[1].integer(), -2);
  EXPECT_EQ(v.find("s")->string(), "x\"\xc3\xa9\xf0\x9f\x98\x80");
  EXPECT_TRUE(v.find("t")->boolean());
  EXPECT_FALSE(v.find("u").has_value());
  EXPECT_EQ(torch_ext::parse_json("{\"k\": \"\xc3\xa9\"}", "raw").root().find("k")->string(), "\xc3\xa9");
}

TEST(CommonJson, RejectsMalformedInput) {
  for (const char* bad : {"{", "{\"a\":1,}", "{\"a\" 1}", "[1 2]", "{\"a\":1.5}", "{\"a\":1e3}",
                          "{\"a\":01}", "{\"a\":\"\\x\"}", "{\"a\":1}}", "{\"a\":1,\"a\":2}",
                          "{\"a\":99999999999999999999}", "{\"a\":\"\\ud800\"}", "{\"a\":tru}", ""}) {
    expect_error([&] { torch_ext::parse_json(bad, "hdr.json"); }, {"hdr.json", "malformed JSON"});
  }
  std::string deep(100, '[');
  expect_error([&] { torch_ext::parse_json(deep, "deep"); }, {"nesting"});
}

TEST(CommonJson, RejectsInvalidUtf8AndADuplicateAmongManyKeys) {
  // Invalid or overlong UTF-8, surrogates encoded raw, code points above U+10FFFF, truncated sequences.
  for (const char* bad : {"{\"\xff\":1}", "{\"\xc0\xaf\":1}", "{\"\xe0\x80\xaf\":1}", "{\"\xed\xa0\x80\":1}",
                          "{\"\xf4\x90\x80\x80\":1}", "{\"\xe2\x82\":1}", "{\"a\":\"\x80\"}"}) {
    expect_error([&] { torch_ext::parse_json(bad, "utf8.json"); }, {"utf8.json", "invalid UTF-8"});
  }
  // 200,000 keys with one duplicate at the end, past the parser's switch from a scan to a hash set.
  // (A scan per key, the quadratic search this replaced, took minutes here: ctest's timeout ends it.)
  std::string text = "{";
  for (int i = 0; i < 200000; ++i) text += "\"tensor." + std::to_string(i) + "\":" + std::to_string(i) + ",";
  const auto doc = torch_ext::parse_json(text.substr(0, text.size() - 1) + "}", "many.json");
  EXPECT_EQ(doc.root().size(), 200000);
  expect_error([&] { torch_ext::parse_json(text + "\"tensor.7\":1}", "dup.json"); }, {"dup.json", "duplicate key \"tensor.7\""});
}

TEST(CommonSha256, MatchesTheStandardsTestVectors) {
  EXPECT_EQ(torch_ext::sha256_hex(""), "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855");
  EXPECT_EQ(torch_ext::sha256_hex("abc"), "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad");
  EXPECT_EQ(torch_ext::sha256_hex("abcdbcdecdefdefgefghfghighijhijkijkljklmklmnlmnomnopnopq"),
            "248d6a61d20638b8e5c026930c3e6039a33ce45964ff2167f6ecedd419db06c1");
  // A million 'a's fed in uneven pieces: the block boundaries fall everywhere.
  torch_ext::Sha256 h;
  const std::string piece(997, 'a');
  int64_t fed = 0;
  for (; fed + 997 <= 1000000; fed += 997) h.update(piece);
  h.update(std::string(1000000 - fed, 'a'));
  EXPECT_EQ(h.hex_digest(), "cdc76e5c9914fb9281a1c7e284d73e67f1809a48a497200e046d39ccc7112cd0");
}

TEST(CommonEnumNames, NamesRoundTripAndAnUnknownNameListsTheChoices) {
  for (Colour c : {Colour::red, Colour::green, Colour::blue}) {
    EXPECT_EQ(torch_ext::enum_from_name<Colour>(torch_ext::enum_name(c)), c);
  }
  EXPECT_EQ(torch_ext::enum_name(Colour::green), "green");
  EXPECT_EQ(torch_ext::FieldCodec<Colour>::expose(Colour::blue), "blue");
  EXPECT_EQ(torch_ext::FieldCodec<Colour>::parse("red", "colour"), Colour::red);
  expect_error([] { torch_ext::enum_from_name<Colour>("mauve"); },
               {"Palette: unknown colour 'mauve'; expected 'red', 'green' or 'blue'"});
  EXPECT_THROW(torch_ext::enum_from_name<Colour>("mauve"), c10::ValueError);
}

namespace {

// Records the handlers' calls, in order, as letters.
class Recorder : public torch_ext::ForkParticipant {
 public:
  explicit Recorder(char tag) : tag_(tag) { torch_ext::register_fork_participant(this); }
  ~Recorder() { torch_ext::unregister_fork_participant(this); }
  void fork_prepare() override { log += std::string(1, tag_) + "p"; }
  void fork_parent() override { log += std::string(1, tag_) + "a"; }
  void fork_child() override { log += std::string(1, tag_) + "c"; }
  std::string log;

 private:
  char tag_;
};

}  // namespace

TEST(CommonFork, EveryParticipantIsCalledPreparedInOrderAndReleasedInReverse) {
  Recorder first('x');
  Recorder second('y');
  // The child reports what its participants saw: prepare then child, for each.
  const int code = torch_ext::testing::run_in_child([&] {
    return first.log == "xpxc" && second.log == "ypyc" ? 0 : 1;
  });
  EXPECT_EQ(code, 0);
  EXPECT_EQ(first.log, "xpxa");
  EXPECT_EQ(second.log, "ypya");
  {
    Recorder gone('z');
  }
  first.log.clear();
  EXPECT_EQ(torch_ext::testing::run_in_child([] { return 0; }), 0);
  EXPECT_EQ(first.log, "xpxa");  // an unregistered participant is not called (it no longer exists)
}

TEST(CommonWait, BoundedWaitsReturnWhenReadyOrAtTheDeadlineInsideTheBlockingSection) {
  std::mutex mutex;
  std::condition_variable cv;
  bool ready = false;
  // A deadline already past (or a negative, or a NaN limit) returns at once, not ready.
  EXPECT_FALSE(torch_ext::wait_until(mutex, cv, torch_ext::deadline_after(-1), [&] { return ready; }));
  EXPECT_FALSE(torch_ext::wait_until(mutex, cv, torch_ext::deadline_after(std::nan("")), [&] { return ready; }));
  // Huge limits do not overflow: the deadline lies ahead.
  EXPECT_GT(torch_ext::deadline_after(1e300), torch_ext::WaitClock::now() + std::chrono::hours(24 * 365));
  ready = true;
  int sections = 0;
  torch_ext::set_blocking_section([&](const std::function<void()>& wait) {
    ++sections;
    wait();
  });
  EXPECT_TRUE(torch_ext::wait_until(mutex, cv, torch_ext::deadline_after(1e9), [&] { return ready; }));
  torch_ext::set_blocking_section(nullptr);
  EXPECT_EQ(sections, 1);
}
