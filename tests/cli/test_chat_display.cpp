// `k3 chat` reply display: reasoning, answer and tool calls from a parsed K3 reply land in their
// own labelled sections, streamed or one-shot alike; colour codes only when asked for.
#include <gtest/gtest.h>

#include <cstdio>
#include <string>

#include "chat/chat.h"
#include "cli/chat_display.h"

namespace {

const char* kReply =
    "Paris is in France.<|close|>think<|sep|><|open|>response<|sep|>Let me check.<|close|>response<|sep|>"
    "<|open|>tools<|sep|><|open|>call tool=\"get_weather\" index=\"1\"<|sep|>"
    "<|open|>argument key=\"city\" type=\"string\"<|sep|>Paris<|close|>argument<|sep|>"
    "<|open|>argument key=\"days\" type=\"number\"<|sep|>3<|close|>argument<|sep|><|close|>call<|sep|>"
    "<|close|>tools<|sep|><|close|>message<|sep|><|end_of_msg|>";

// Feeds the reply in pieces of `step` bytes through the parser into a Display; returns the screen.
std::string show(size_t step, bool color) {
  char* buf = nullptr;
  size_t len = 0;
  std::FILE* f = open_memstream(&buf, &len);
  {
    k3::cli::Display d(color, f);
    k3::chat::OutputParser p(true);
    const std::string text = kReply;
    for (size_t i = 0; i < text.size(); i += step)
      for (const auto& e : p.feed(std::string_view(text).substr(i, step))) d.on_event(e);
    for (const auto& e : p.finish()) d.on_event(e);
    d.end_reply();
  }
  std::fclose(f);
  std::string s(buf, len);
  std::free(buf);
  return s;
}

}  // namespace

TEST(ChatDisplay, SectionsAndToolCallLines) {
  const std::string s = show(1 << 20, false);
  EXPECT_EQ(s.rfind("[thinking] Paris is in France.\n[answer] Let me check.\n[tool call] get_weather ", 0), 0u) << s;
  const size_t call = s.find("[tool call] get_weather ");
  const std::string args = s.substr(call + 24, s.find('\n', call) - call - 24);
  const auto j = nlohmann::json::parse(args);  // the arguments line is JSON
  EXPECT_EQ(j["city"], "Paris");
  EXPECT_EQ(j["days"], 3);
  EXPECT_EQ(s.back(), '\n');
  EXPECT_EQ(s.find("<|"), std::string::npos) << "markers leaked: " << s;
  EXPECT_EQ(s.find('\x1b'), std::string::npos);
}

TEST(ChatDisplay, StreamingEqualsOneShot) {
  const std::string whole = show(1 << 20, false);
  for (size_t step : {1, 2, 3, 7, 13}) EXPECT_EQ(show(step, false), whole) << "step " << step;
}

TEST(ChatDisplay, ColourDimsOnlyTheReasoning) {
  const std::string s = show(5, true);
  const size_t dim = s.find("\x1b[2m"), reset = s.find("\x1b[0m");
  ASSERT_NE(dim, std::string::npos);
  ASSERT_NE(reset, std::string::npos);
  EXPECT_LT(dim, s.find("Paris is in France."));
  EXPECT_LT(s.find("Paris is in France."), reset);
  EXPECT_LT(reset, s.find("[answer]"));
}
