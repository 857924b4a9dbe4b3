// A minimal HTTP/1.1 exchange over a loopback socket for tests that talk to the project's own
// HTTP endpoints (/metrics, the load-balance page): raw bytes out, the whole response back.
//
//   const std::string r = HttpExchange(port, "GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n");
//   HttpStatusOf(r) == 200; HttpBodyOf(r)
#ifndef MOE_TESTS_COMMON_HTTP_CLIENT_H_
#define MOE_TESTS_COMMON_HTTP_CLIENT_H_

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <string>

namespace moe::testing {

// Sends raw bytes to 127.0.0.1:port and returns everything read until the peer closes (bounded
// to 10000 reads); "" when nothing listens.
inline std::string HttpExchange(int port, const std::string& request) {
  const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in a = {};
  a.sin_family = AF_INET;
  a.sin_port = htons(static_cast<uint16_t>(port));
  ::inet_pton(AF_INET, "127.0.0.1", &a.sin_addr);
  if (::connect(fd, reinterpret_cast<sockaddr*>(&a), sizeof(a)) != 0) {
    ::close(fd);
    return "";
  }
  ::send(fd, request.data(), request.size(), MSG_NOSIGNAL);
  std::string out;
  char buf[4096];
  for (int i = 0; i < 10000; ++i) {
    const ssize_t n = ::recv(fd, buf, sizeof(buf), 0);
    if (n <= 0) break;
    out.append(buf, static_cast<size_t>(n));
  }
  ::close(fd);
  return out;
}

inline int HttpStatusOf(const std::string& response) {
  return response.size() > 12 ? std::stoi(response.substr(9, 3)) : 0;
}

inline std::string HttpBodyOf(const std::string& response) {
  const size_t p = response.find("\r\n\r\n");
  return p == std::string::npos ? "" : response.substr(p + 4);
}

}  // namespace moe::testing

#endif  // MOE_TESTS_COMMON_HTTP_CLIENT_H_
