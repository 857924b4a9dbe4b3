// The C++ quick-start of docs/clients.md, built against the installed SDK: model info, then one
// Forward.
//   consumer ATTENTION_HOST:PORT [CA_FILE CERT_FILE KEY_FILE]   (mutual TLS: moe-cli up's default,
//   the files from its cluster.json "tls")
#include <cstdio>
#include <vector>

#include "services/client/moe_client.h"

int main(int argc, char** argv) {
  if (argc != 2 && argc != 5) {
    std::fprintf(stderr, "usage: consumer ATTENTION_HOST:PORT [CA_FILE CERT_FILE KEY_FILE]\n");
    return 2;
  }
  moe::client::ClientOptions o;
  o.attention = argv[1];
  if (argc == 5) {
    o.tls.ca_file = argv[2];
    o.tls.cert_file = argv[3];
    o.tls.key_file = argv[4];
  }
  auto client = moe::client::MoeClient::Create(o);
  if (!client.ok()) return 1;
  auto info = (*client)->GetModelInfo();
  if (!info.ok()) {
    std::fprintf(stderr, "GetModelInfo: %s\n", info.status().ToString().c_str());
    return 1;
  }
  const int64_t tokens = 4, hidden = info->hidden();
  std::vector<moe::tensor::Bf16> x(tokens * hidden);
  for (size_t i = 0; i < x.size(); ++i) x[i] = moe::tensor::Bf16::FromFloat(0.01f * (i % 97));
  auto out = (*client)->Forward(info->layers(0), x, tokens, hidden);
  if (!out.ok()) {
    std::fprintf(stderr, "Forward: %s\n", out.status().ToString().c_str());
    return 1;
  }
  std::printf("model %s: hidden %d, %d experts, top %d, layer %d; out [%lld, %lld]\n",
              info->model().c_str(), info->hidden(), info->num_experts(), info->top_k(),
              info->layers(0), static_cast<long long>(out->tokens),
              static_cast<long long>(out->width));
  return 0;
}
