// The one command-line flag library of every binary of the project (the three services,
// moe-cli and its subcommands, moe-tool, qb-sim): --name=value or --name value, boolean flags
// as --name, --name=true|false; --help prints the usage and exits 0, --version the program and
// the build's version (version.h) and exits 0; an unknown or misspelled
// flag is an error that names the nearest known flag. Flag names are snake_case. Each flag
// writes straight into a field of an Options struct, whose in-struct default is the flag's
// default (one source of defaults).
//
//   SvcFlags flags("expert-svc", "Serves experts.");
//   flags.Int("port", &o.port, "listen port");
//   if (int rc = flags.Parse(argc, argv); rc >= 0) return rc;
//
// (Abseil Flags was measured against it and not taken: its flags are process-wide, while
// moe-cli gives every subcommand its own set with its own --help, and its --help exits 1.)
#ifndef MOE_SERVICES_COMMON_FLAGS_H_
#define MOE_SERVICES_COMMON_FLAGS_H_

#include <cstdint>
#include <cstdio>
#include <functional>
#include <string>
#include <vector>

#include "services/common/enum_names.h"

namespace moe {

class SvcFlags {
 public:
  SvcFlags(std::string program, std::string summary);

  void String(const std::string& name, std::string* v, const std::string& help);
  void Int(const std::string& name, int* v, const std::string& help);
  void Int64(const std::string& name, int64_t* v, const std::string& help);
  void Uint64(const std::string& name, uint64_t* v, const std::string& help);
  void Double(const std::string& name, double* v, const std::string& help);
  void Bool(const std::string& name, bool* v, const std::string& help);
  // Any type: parse returns false on a bad value.
  void Custom(const std::string& name, const std::string& default_text, const std::string& help,
              std::function<bool(const std::string&)> parse);
  // Comma-separated integers.
  void IntList(const std::string& name, std::vector<int64_t>* v, const std::string& help);
  // A typed value (an enum) by its own parser and name functions: parse(text) returns a status
  // or T (a bad value prints its message), name_of(T) gives the default's text.
  //   flags.Typed("bias_mode", &o.bias_mode, BiasModeName, ParseBiasMode, "frozen|rebalance");
  template <typename T, typename NameOf, typename ParseFn>
  void Typed(const std::string& name, T* v, NameOf name_of, ParseFn parse,
             const std::string& help) {
    Custom(name, name_of(*v), help, [v, parse](const std::string& text) {
      auto parsed = parse(text);
      if (!parsed.ok()) {
        std::fprintf(stderr, "%s\n", std::string(parsed.status().message()).c_str());
        return false;
      }
      *v = *parsed;
      return true;
    });
  }

  // An enum by its table (enum_names.h): the value's name is the default's text, and the help
  // starts with the choices.
  //   flags.Enum("bias_mode", &o.bias_mode, kBiasModes, "how the bias moves");
  template <typename E, size_t N>
  void Enum(const std::string& name, E* v, const EnumNames<E, N>& names, const std::string& help) {
    const EnumNames<E, N>* table = &names;  // a table is a constant of static storage
    Typed(
        name, v, [table](E e) { return std::string(table->Name(e)); },
        [table](const std::string& text) { return table->Parse(text); },
        table->Choices() + ": " + help);
  }

  // Parses argv[first..]. Returns -1 to go on; 0 after --help (or -h) printed the usage; 2
  // after a bad flag printed what is wrong (an unknown name, with the nearest known one; a
  // missing or malformed value). Positional arguments are collected in positional(), and
  // `--` ends the flags. main(): if (int rc = flags.Parse(argc, argv); rc >= 0) return rc;
  int Parse(int argc, char** argv, int first = 1);
  const std::vector<std::string>& positional() const { return positional_; }
  void PrintUsage(std::FILE* out) const;

 private:
  struct Flag {
    std::string name, help, default_text;
    bool is_bool = false;
    std::function<bool(const std::string&)> set;
  };
  void Add(Flag f);
  std::string Nearest(const std::string& name) const;
  std::string program_, summary_;
  std::vector<Flag> flags_;
  std::vector<std::string> positional_;
};

}  // namespace moe

#endif  // MOE_SERVICES_COMMON_FLAGS_H_
