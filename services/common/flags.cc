#include "services/common/flags.h"

#include <algorithm>
#include <utility>

#include "absl/strings/numbers.h"
#include "absl/strings/str_split.h"
#include "services/common/allocator.h"
#include "services/common/logging.h"
#include "services/common/version.h"

namespace moe {

SvcFlags::SvcFlags(std::string program, std::string summary)
    : program_(std::move(program)), summary_(std::move(summary)) {
  Custom("log_level", "info", "trace|debug|info|warn|error|off: what is logged to stderr",
         [](const std::string& level) {
           if (SetLogLevel(level)) return true;
           std::fprintf(stderr, "unknown log level '%s'\n", level.c_str());
           return false;
         });
}

void SvcFlags::Add(Flag f) { flags_.push_back(std::move(f)); }

void SvcFlags::String(const std::string& name, std::string* v, const std::string& help) {
  Add({name, help, *v, false, [v](const std::string& s) {
         *v = s;
         return true;
       }});
}

void SvcFlags::Int(const std::string& name, int* v, const std::string& help) {
  Add({name, help, std::to_string(*v), false,
       [v](const std::string& s) { return absl::SimpleAtoi(s, v); }});
}

void SvcFlags::Int64(const std::string& name, int64_t* v, const std::string& help) {
  Add({name, help, std::to_string(*v), false,
       [v](const std::string& s) { return absl::SimpleAtoi(s, v); }});
}

void SvcFlags::Uint64(const std::string& name, uint64_t* v, const std::string& help) {
  Add({name, help, std::to_string(*v), false,
       [v](const std::string& s) { return absl::SimpleAtoi(s, v); }});
}

void SvcFlags::Double(const std::string& name, double* v, const std::string& help) {
  Add({name, help, std::to_string(*v), false,
       [v](const std::string& s) { return absl::SimpleAtod(s, v); }});
}

void SvcFlags::Bool(const std::string& name, bool* v, const std::string& help) {
  Add({name, help, *v ? "true" : "false", true, [v](const std::string& s) {
         if (s == "true" || s == "1" || s.empty()) {
           *v = true;
         } else if (s == "false" || s == "0") {
           *v = false;
         } else {
           return false;
         }
         return true;
       }});
}

void SvcFlags::Custom(const std::string& name, const std::string& default_text,
                      const std::string& help, std::function<bool(const std::string&)> parse) {
  Add({name, help, default_text, false, std::move(parse)});
}

void SvcFlags::IntList(const std::string& name, std::vector<int64_t>* v, const std::string& help) {
  std::string def;
  for (int64_t x : *v) def += (def.empty() ? "" : ",") + std::to_string(x);
  Add({name, help, def, false, [v](const std::string& s) {
         v->clear();
         if (s.empty()) return true;
         for (absl::string_view part : absl::StrSplit(s, ',')) {
           int64_t x;
           if (!absl::SimpleAtoi(part, &x)) return false;
           v->push_back(x);
         }
         return true;
       }});
}

void SvcFlags::PrintUsage(std::FILE* out) const {
  std::fprintf(out, "%s: %s\nflags:\n", program_.c_str(), summary_.c_str());
  for (const Flag& f : flags_) {
    std::fprintf(out, "  --%s  %s (default: %s)\n", f.name.c_str(), f.help.c_str(),
                 f.default_text.empty() ? "\"\"" : f.default_text.c_str());
  }
}

int SvcFlags::Parse(int argc, char** argv, int first) {
  bool flags_done = false;
  for (int i = first; i < argc; ++i) {
    std::string arg = argv[i];
    if (!flags_done && (arg == "--help" || arg == "-h")) {
      PrintUsage(stdout);
      return 0;
    }
    if (!flags_done && arg == "--version") {
      std::printf("%s %s\nallocator: %s\n", program_.c_str(), BuildVersion(), AllocatorName());
      return 0;
    }
    if (!flags_done && arg == "--") {
      flags_done = true;
      continue;
    }
    if (flags_done || arg.rfind("--", 0) != 0) {
      positional_.push_back(arg);
      continue;
    }
    std::string name = arg.substr(2), value;
    bool has_value = false;
    if (const size_t eq = name.find('='); eq != std::string::npos) {
      value = name.substr(eq + 1);
      name = name.substr(0, eq);
      has_value = true;
    }
    const Flag* flag = nullptr;
    for (const Flag& f : flags_) {
      if (f.name == name) flag = &f;
    }
    if (flag == nullptr) {
      const std::string near = Nearest(name);
      std::fprintf(stderr, "%s: unknown flag --%s%s (see --help)\n", program_.c_str(), name.c_str(),
                   near.empty() ? "" : (", did you mean --" + near + "?").c_str());
      return 2;
    }
    if (!has_value && !flag->is_bool) {
      if (i + 1 >= argc) {
        std::fprintf(stderr, "%s: --%s needs a value\n", program_.c_str(), name.c_str());
        return 2;
      }
      value = argv[++i];
    }
    if (!flag->set(value)) {
      std::fprintf(stderr, "%s: bad value '%s' for --%s\n", program_.c_str(), value.c_str(),
                   name.c_str());
      return 2;
    }
  }
  return -1;
}

std::string SvcFlags::Nearest(const std::string& name) const {
  // Levenshtein distance; a name within 2 edits (or a different spelling of - and _) is offered.
  auto distance = [](const std::string& a, const std::string& b) {
    std::vector<size_t> prev(b.size() + 1), cur(b.size() + 1);
    for (size_t j = 0; j <= b.size(); ++j) prev[j] = j;
    for (size_t i = 1; i <= a.size(); ++i) {
      cur[0] = i;
      for (size_t j = 1; j <= b.size(); ++j) {
        const bool same = a[i - 1] == b[j - 1] || (a[i - 1] == '-' && b[j - 1] == '_');
        cur[j] = std::min({prev[j] + 1, cur[j - 1] + 1, prev[j - 1] + (same ? 0 : 1)});
      }
      prev.swap(cur);
    }
    return prev[b.size()];
  };
  std::string best;
  size_t best_d = 3;
  for (const Flag& f : flags_) {
    const size_t d = distance(name, f.name);
    if (d < best_d) {
      best_d = d;
      best = f.name;
    }
  }
  return best;
}

}  // namespace moe
