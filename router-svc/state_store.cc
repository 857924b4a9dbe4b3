#include "router-svc/state_store.h"

#include <sqlite3.h>
#include <sys/stat.h>

#include <cstring>
#include <mutex>
#include <utility>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "router-svc/router_proto.h"

namespace moe::router_svc {
namespace {

constexpr char kSchema[] = R"sql(
CREATE TABLE IF NOT EXISTS bias_versions (
  layer INTEGER NOT NULL, version INTEGER NOT NULL, mode TEXT NOT NULL, reason TEXT NOT NULL,
  created_unix_ms INTEGER NOT NULL, bias BLOB NOT NULL, PRIMARY KEY (layer, version));
CREATE TABLE IF NOT EXISTS modes (
  layer INTEGER PRIMARY KEY, mode TEXT NOT NULL, continuous_tokens INTEGER NOT NULL);
CREATE TABLE IF NOT EXISTS shards (
  name TEXT PRIMARY KEY, endpoint TEXT NOT NULL, lease INTEGER NOT NULL,
  data_plane TEXT NOT NULL, ranges TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value INTEGER NOT NULL);
)sql";

// "layer:lo:hi,layer:lo:hi"
std::string RangesText(const std::vector<LayerRange>& ranges) {
  std::string out;
  for (const LayerRange& r : ranges) {
    absl::StrAppend(&out, out.empty() ? "" : ",", r.layer, ":", r.lo, ":", r.hi);
  }
  return out;
}

bool ParseRanges(const std::string& text, std::vector<LayerRange>* out) {
  for (absl::string_view part : absl::StrSplit(text, ',', absl::SkipEmpty())) {
    std::vector<absl::string_view> f = absl::StrSplit(part, ':');
    LayerRange r;
    if (f.size() != 3 || !absl::SimpleAtoi(f[0], &r.layer) || !absl::SimpleAtoi(f[1], &r.lo) ||
        !absl::SimpleAtoi(f[2], &r.hi)) {
      return false;
    }
    out->push_back(r);
  }
  return true;
}

class SqliteStore final : public StateStore {
 public:
  explicit SqliteStore(sqlite3* db) : db_(db) {}
  ~SqliteStore() override { sqlite3_close(db_); }

  absl::Status Init() {
    for (const char* sql : {"PRAGMA journal_mode=WAL;", "PRAGMA synchronous=FULL;", kSchema}) {
      if (absl::Status s = Exec(sql); !s.ok()) return s;
    }
    // A state made before dynamic k has no budget column: its versions have no budget (empty).
    bool has_budget = false;
    absl::Status q = Query("PRAGMA table_info(bias_versions)", [&](sqlite3_stmt* st) {
      has_budget |=
          std::strcmp(reinterpret_cast<const char*>(sqlite3_column_text(st, 1)), "budget") == 0;
    });
    if (!q.ok()) return q;
    if (!has_budget) {
      return Exec("ALTER TABLE bias_versions ADD COLUMN budget BLOB NOT NULL DEFAULT x'';");
    }
    return absl::OkStatus();
  }

  absl::StatusOr<StoredState> Load() override {
    std::lock_guard<std::mutex> lock(mu_);
    StoredState state;
    absl::Status bad;
    auto row_error = [&](const std::string& what) {
      if (bad.ok()) bad = absl::DataLossError(absl::StrCat("router state: ", what));
    };
    absl::Status q = Query(
        "SELECT layer, version, mode, reason, created_unix_ms, bias, budget FROM bias_versions "
        "ORDER BY layer, version",
        [&](sqlite3_stmt* st) {
          BiasVersion v;
          v.layer = sqlite3_column_int(st, 0);
          v.version = static_cast<uint64_t>(sqlite3_column_int64(st, 1));
          absl::StatusOr<BiasMode> mode =
              ParseBiasMode(reinterpret_cast<const char*>(sqlite3_column_text(st, 2)));
          v.reason = reinterpret_cast<const char*>(sqlite3_column_text(st, 3));
          v.created_unix_ms = sqlite3_column_int64(st, 4);
          const int bytes = sqlite3_column_bytes(st, 5);
          if (!mode.ok() || bytes % 4 != 0) {
            row_error(absl::StrCat("layer ", v.layer, " version ", v.version, " is malformed"));
            return;
          }
          v.mode = *mode;
          v.bias.resize(static_cast<size_t>(bytes / 4));
          if (bytes > 0) std::memcpy(v.bias.data(), sqlite3_column_blob(st, 5), bytes);
          v1::ExpertBudget budget;
          const int budget_bytes = sqlite3_column_bytes(st, 6);
          if (budget_bytes > 0 &&
              !budget.ParseFromArray(sqlite3_column_blob(st, 6), budget_bytes)) {
            row_error(absl::StrCat("layer ", v.layer, " version ", v.version, ": a bad budget"));
            return;
          }
          v.budget = FromProto(budget);
          std::vector<BiasVersion>& h = state.layers[v.layer].history;
          if (v.version != h.size()) {
            row_error(absl::StrCat("layer ", v.layer, " has version ", v.version, " after ",
                                   h.size(), " versions (a gap)"));
            return;
          }
          h.push_back(std::move(v));
        });
    if (!q.ok()) return q;
    q = Query("SELECT layer, mode, continuous_tokens FROM modes", [&](sqlite3_stmt* st) {
      const int32_t layer = sqlite3_column_int(st, 0);
      absl::StatusOr<BiasMode> mode =
          ParseBiasMode(reinterpret_cast<const char*>(sqlite3_column_text(st, 1)));
      if (!mode.ok()) return row_error(absl::StrCat("layer ", layer, ": a bad mode"));
      state.layers[layer].mode = *mode;
      state.layers[layer].continuous_tokens = sqlite3_column_int64(st, 2);
    });
    if (!q.ok()) return q;
    q = Query(
        "SELECT name, endpoint, lease, data_plane, ranges FROM shards ORDER BY name",
        [&](sqlite3_stmt* st) {
          StoredShard s;
          s.name = reinterpret_cast<const char*>(sqlite3_column_text(st, 0));
          s.endpoint = reinterpret_cast<const char*>(sqlite3_column_text(st, 1));
          s.lease = static_cast<uint64_t>(sqlite3_column_int64(st, 2));
          s.data_plane = reinterpret_cast<const char*>(sqlite3_column_text(st, 3));
          if (!ParseRanges(reinterpret_cast<const char*>(sqlite3_column_text(st, 4)), &s.ranges)) {
            return row_error(absl::StrCat("shard ", s.name, ": bad ranges"));
          }
          state.shards.push_back(std::move(s));
        });
    if (!q.ok()) return q;
    q = Query("SELECT value FROM meta WHERE key = 'initialized_unix_ms'",
              [&](sqlite3_stmt* st) { state.initialized_unix_ms = sqlite3_column_int64(st, 0); });
    if (!q.ok()) return q;
    for (const auto& [layer, l] : state.layers) {
      if (l.history.empty()) row_error(absl::StrCat("layer ", layer, " has a mode but no bias"));
    }
    if (!bad.ok()) return bad;
    return state;
  }

  absl::Status PutBiasVersion(const BiasVersion& v) override {
    std::lock_guard<std::mutex> lock(mu_);
    const std::string budget = ToProto(v.budget).SerializeAsString();
    return Write("INSERT OR REPLACE INTO bias_versions VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7)",
                 [&](sqlite3_stmt* st) {
                   sqlite3_bind_int(st, 1, v.layer);
                   sqlite3_bind_int64(st, 2, static_cast<sqlite3_int64>(v.version));
                   sqlite3_bind_text(st, 3, BiasModeName(v.mode), -1, SQLITE_STATIC);
                   sqlite3_bind_text(st, 4, v.reason.c_str(), -1, SQLITE_TRANSIENT);
                   sqlite3_bind_int64(st, 5, v.created_unix_ms);
                   sqlite3_bind_blob(st, 6, v.bias.data(), static_cast<int>(v.bias.size() * 4),
                                     SQLITE_TRANSIENT);
                   sqlite3_bind_blob(st, 7, budget.data(), static_cast<int>(budget.size()),
                                     SQLITE_TRANSIENT);
                 });
  }

  absl::Status PutMode(int32_t layer, BiasMode mode, int64_t continuous_tokens) override {
    std::lock_guard<std::mutex> lock(mu_);
    return Write("INSERT OR REPLACE INTO modes VALUES (?1, ?2, ?3)", [&](sqlite3_stmt* st) {
      sqlite3_bind_int(st, 1, layer);
      sqlite3_bind_text(st, 2, BiasModeName(mode), -1, SQLITE_STATIC);
      sqlite3_bind_int64(st, 3, continuous_tokens);
    });
  }

  absl::Status PutShard(const StoredShard& s) override {
    std::lock_guard<std::mutex> lock(mu_);
    const std::string ranges = RangesText(s.ranges);
    return Write("INSERT OR REPLACE INTO shards VALUES (?1, ?2, ?3, ?4, ?5)",
                 [&](sqlite3_stmt* st) {
                   sqlite3_bind_text(st, 1, s.name.c_str(), -1, SQLITE_TRANSIENT);
                   sqlite3_bind_text(st, 2, s.endpoint.c_str(), -1, SQLITE_TRANSIENT);
                   sqlite3_bind_int64(st, 3, static_cast<sqlite3_int64>(s.lease));
                   sqlite3_bind_text(st, 4, s.data_plane.c_str(), -1, SQLITE_TRANSIENT);
                   sqlite3_bind_text(st, 5, ranges.c_str(), -1, SQLITE_TRANSIENT);
                 });
  }

  absl::Status DeleteShard(const std::string& name) override {
    std::lock_guard<std::mutex> lock(mu_);
    return Write("DELETE FROM shards WHERE name = ?1", [&](sqlite3_stmt* st) {
      sqlite3_bind_text(st, 1, name.c_str(), -1, SQLITE_TRANSIENT);
    });
  }

  absl::Status MarkInitialized(int64_t unix_ms) override {
    std::lock_guard<std::mutex> lock(mu_);
    return Write("INSERT OR REPLACE INTO meta VALUES ('initialized_unix_ms', ?1)",
                 [&](sqlite3_stmt* st) { sqlite3_bind_int64(st, 1, unix_ms); });
  }

 private:
  absl::Status Error(const std::string& what) const {
    return absl::InternalError(
        absl::StrCat("router state (SQLite): ", what, ": ", sqlite3_errmsg(db_)));
  }

  absl::Status Exec(const char* sql) {
    char* err = nullptr;
    if (sqlite3_exec(db_, sql, nullptr, nullptr, &err) != SQLITE_OK) {
      const std::string msg = err != nullptr ? err : "?";
      sqlite3_free(err);
      return absl::InternalError(absl::StrCat("router state (SQLite): ", msg));
    }
    return absl::OkStatus();
  }

  // One statement, one implicit transaction: on disk (WAL, synchronous FULL) when it returns,
  // then checkpointed into the main file and the WAL truncated, so that the db file alone holds
  // every commit (a backup that copies only it, a lost -wal after a kill -9).
  template <typename Bind>
  absl::Status Write(const char* sql, Bind bind) {
    sqlite3_stmt* st = nullptr;
    if (sqlite3_prepare_v2(db_, sql, -1, &st, nullptr) != SQLITE_OK) return Error(sql);
    bind(st);
    const int rc = sqlite3_step(st);
    sqlite3_finalize(st);
    if (rc != SQLITE_DONE) return Error(sql);
    if (sqlite3_wal_checkpoint_v2(db_, nullptr, SQLITE_CHECKPOINT_TRUNCATE, nullptr, nullptr) !=
        SQLITE_OK) {
      return Error("checkpointing the WAL into the db file");
    }
    return absl::OkStatus();
  }

  template <typename Row>
  absl::Status Query(const char* sql, Row row) {
    sqlite3_stmt* st = nullptr;
    if (sqlite3_prepare_v2(db_, sql, -1, &st, nullptr) != SQLITE_OK) return Error(sql);
    int rc;
    while ((rc = sqlite3_step(st)) == SQLITE_ROW) row(st);
    sqlite3_finalize(st);
    return rc == SQLITE_DONE ? absl::OkStatus() : Error(sql);
  }

  sqlite3* db_;
  std::mutex mu_;
};

}  // namespace

absl::StatusOr<std::unique_ptr<StateStore>> OpenSqliteStore(const std::string& path, bool create) {
  struct stat st;
  if (!create && ::stat(path.c_str(), &st) != 0) {
    return absl::NotFoundError(absl::StrCat(
        "the router state ", path,
        " does not exist: restore it from a backup (docs/operations.md), or start router-svc "
        "once with --initialize to make a new cluster's state"));
  }
  sqlite3* db = nullptr;
  if (sqlite3_open_v2(path.c_str(), &db, SQLITE_OPEN_READWRITE | (create ? SQLITE_OPEN_CREATE : 0),
                      nullptr) != SQLITE_OK) {
    const std::string msg = db != nullptr ? sqlite3_errmsg(db) : "out of memory";
    sqlite3_close(db);
    return absl::UnavailableError(absl::StrCat("cannot open the router state ", path, ": ", msg));
  }
  auto store = std::make_unique<SqliteStore>(db);
  if (absl::Status s = store->Init(); !s.ok()) return s;
  return std::unique_ptr<StateStore>(std::move(store));
}

}  // namespace moe::router_svc
