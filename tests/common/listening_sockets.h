// The TCP sockets a process listens on, read from the kernel (/proc/PID/fd for the socket
// inodes, /proc/net/tcp and tcp6 for their addresses): what a test asserts about which
// interfaces a service really binds, whatever its configuration says.
//
//   for (const auto& s : ListeningSockets(getpid())) EXPECT_TRUE(s.loopback) << s.address;
#ifndef MOE_TESTS_COMMON_LISTENING_SOCKETS_H_
#define MOE_TESTS_COMMON_LISTENING_SOCKETS_H_

#include <dirent.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <set>
#include <sstream>
#include <string>
#include <vector>

namespace moe::testing {

struct ListeningSocket {
  std::string address;  // "127.0.0.1:4000", "[::ffff:127.0.0.1]:4000", "[::]:4000"
  bool loopback = false;
};

inline std::vector<ListeningSocket> ListeningSockets(pid_t pid) {
  std::set<std::string> inodes;
  const std::string fd_dir = "/proc/" + std::to_string(pid) + "/fd";
  if (DIR* d = opendir(fd_dir.c_str())) {
    while (dirent* e = readdir(d)) {
      char target[256];
      const std::string path = fd_dir + "/" + e->d_name;
      const ssize_t n = readlink(path.c_str(), target, sizeof(target) - 1);
      if (n <= 0) continue;
      target[n] = '\0';
      const std::string t(target);
      if (t.rfind("socket:[", 0) == 0) inodes.insert(t.substr(8, t.size() - 9));
    }
    closedir(d);
  }
  std::vector<ListeningSocket> out;
  for (const char* table : {"/proc/net/tcp", "/proc/net/tcp6"}) {
    const bool v6 = std::string(table).back() == '6';
    std::ifstream f(table);
    std::string line;
    std::getline(f, line);  // header
    while (std::getline(f, line)) {
      std::istringstream in(line);
      std::string slot, local, remote, state, queues, timer, retr, uid, timeout, inode;
      in >> slot >> local >> remote >> state >> queues >> timer >> retr >> uid >> timeout >> inode;
      if (state != "0A" || inodes.count(inode) == 0) continue;  // 0A: LISTEN
      const std::string hex = local.substr(0, local.find(':'));
      const int port =
          static_cast<int>(std::strtol(local.substr(local.find(':') + 1).c_str(), nullptr, 16));
      ListeningSocket s;
      if (!v6) {
        // Four bytes in host (little-endian) order: the first octet is the last pair.
        const unsigned long a = std::strtoul(hex.c_str(), nullptr, 16);
        char buf[32];
        std::snprintf(buf, sizeof(buf), "%lu.%lu.%lu.%lu:%d", a & 255, (a >> 8) & 255,
                      (a >> 16) & 255, (a >> 24) & 255, port);
        s.address = buf;
        s.loopback = (a & 255) == 127;
      } else {
        // Four 32-bit words, each in host order. ::1 and ::ffff:127.x.y.z are loopback.
        unsigned long w[4];
        for (int i = 0; i < 4; ++i) w[i] = std::strtoul(hex.substr(i * 8, 8).c_str(), nullptr, 16);
        const bool v4mapped = w[0] == 0 && w[1] == 0 && w[2] == 0xFFFF0000ul;
        s.loopback = (w[0] == 0 && w[1] == 0 && w[2] == 0 && w[3] == 0x01000000ul) ||
                     (v4mapped && (w[3] & 255) == 127);
        char buf[96];
        if (v4mapped) {
          std::snprintf(buf, sizeof(buf), "[::ffff:%lu.%lu.%lu.%lu]:%d", w[3] & 255,
                        (w[3] >> 8) & 255, (w[3] >> 16) & 255, (w[3] >> 24) & 255, port);
        } else {
          std::snprintf(buf, sizeof(buf), "[%08lx%08lx%08lx%08lx]:%d", w[0], w[1], w[2], w[3],
                        port);
        }
        s.address = buf;
      }
      out.push_back(s);
    }
  }
  return out;
}

}  // namespace moe::testing

#endif  // MOE_TESTS_COMMON_LISTENING_SOCKETS_H_
