// The chat-format interface: XTML (K3) and K2 (Kimi Linear's checkpoint) behind chat::ChatFormat, and
// the choice of format from a checkpoint directory.
#include <filesystem>
#include <fstream>
#include <sstream>

#include "chat/chat.h"
#include "core/error.h"

namespace k3::chat {

namespace {

class XtmlFormat final : public ChatFormat {
 public:
  Format id() const override { return Format::Xtml; }
  std::vector<Segment> render(const std::vector<Message>& msgs, const RenderOptions& opt) const override {
    return chat::render(msgs, opt);
  }
  bool prompt_opens_reasoning(const RenderOptions& opt) const override {
    return opt.thinking && opt.thinking_effort != "none";
  }
  std::unique_ptr<StreamParser> parser(bool prompt_opens_reasoning) const override {
    return std::make_unique<OutputParser>(prompt_opens_reasoning);
  }
  std::string end_marker() const override { return "<|end_of_msg|>"; }
  std::string call_id(const std::string&, size_t k, int64_t turn) const override {
    return "call_" + std::to_string(turn + 1) + "_" + std::to_string(k + 1);
  }
};

class K2Format final : public ChatFormat {
 public:
  Format id() const override { return Format::K2; }
  std::vector<Segment> render(const std::vector<Message>& msgs, const RenderOptions& opt) const override {
    return render_k2(msgs, opt);
  }
  // The template's generation prompt is the bare assistant header; a reply may still open <think>.
  bool prompt_opens_reasoning(const RenderOptions&) const override { return false; }
  std::unique_ptr<StreamParser> parser(bool prompt_opens_reasoning) const override {
    return std::make_unique<K2OutputParser>(prompt_opens_reasoning);
  }
  std::string end_marker() const override { return "<|im_end|>"; }
  // The model's own form: the call's index within its message (0-based).
  std::string call_id(const std::string& name, size_t k, int64_t) const override {
    return "functions." + name + ":" + std::to_string(k);
  }
};

std::string read_text(const std::filesystem::path& p) {
  std::ifstream f(p, std::ios::binary);
  std::ostringstream ss;
  ss << f.rdbuf();
  return ss.str();
}

// The checkpoint's chat template text ("" when it has none).
std::string template_text(const std::string& dir, std::string* where) {
  namespace fs = std::filesystem;
  const fs::path cfg = fs::path(dir) / "tokenizer_config.json";
  std::error_code ec;
  if (fs::exists(cfg, ec)) {
    const auto j = nlohmann::json::parse(read_text(cfg), nullptr, false);
    if (!j.is_discarded() && j.is_object() && j.contains("chat_template")) {
      const auto& t = j["chat_template"];
      std::string s;
      if (t.is_string()) {
        s = t.get<std::string>();
      } else if (t.is_array()) {  // [{"name": ..., "template": ...}, ...]
        for (const auto& e : t)
          if (e.is_object() && e.contains("template") && e["template"].is_string()) s += e["template"].get<std::string>();
      }
      if (!s.empty()) {
        *where = "tokenizer_config.json chat_template";
        return s;
      }
    }
  }
  const fs::path jinja = fs::path(dir) / "chat_template.jinja";
  if (fs::exists(jinja, ec)) {
    *where = "chat_template.jinja";
    return read_text(jinja);
  }
  return "";
}

}  // namespace

const ChatFormat& chat_format(Format f) {
  static const XtmlFormat xtml;
  static const K2Format k2;
  return f == Format::K2 ? static_cast<const ChatFormat&>(k2) : static_cast<const ChatFormat&>(xtml);
}

std::string format_name(Format f) { return f == Format::K2 ? "k2" : "xtml"; }

Format parse_format_name(const std::string& name) {
  if (name == "xtml") return Format::Xtml;
  if (name == "k2") return Format::K2;
  throw Error("chat format '" + name + "' is not one of xtml, k2");
}

Format detect_format(const std::string& dir, const std::string& model_type, std::string* why) {
  std::string where;
  const std::string t = template_text(dir, &where);
  auto has = [&](const char* m) { return t.find(m) != std::string::npos; };
  const bool k2 = has("<|im_user|>") || has("<|im_assistant|>") || has("<|im_end|>");
  const bool xtml = has("<|open|>") || has("<|end_of_msg|>");
  if (k2 != xtml) {
    if (why) *why = where + " has " + (k2 ? "K2" : "XTML") + " markers";
    return k2 ? Format::K2 : Format::Xtml;
  }
  if (model_type == "kimi_linear") {
    if (why) *why = "model_type kimi_linear";
    return Format::K2;
  }
  if (why) *why = "the K3 default";
  return Format::Xtml;
}

}  // namespace k3::chat
