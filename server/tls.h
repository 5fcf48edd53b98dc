// Transport credentials of the daemon's gRPC listener (SPEC §11):
//   - a Unix socket: no TLS (identity comes from the companion socket's
//     SO_PEERCRED);
//   - TCP on a loopback address without TLS: allowed, anonymous (granted
//     nothing the config does not grant);
//   - TCP on any other address: only with mutual TLS (--tls_cert, --tls_key,
//     --tls_client_ca); refused at start otherwise.
// Certificates and the client CA are re-read from their files every
// `refresh` (gRPC's file watcher): rotating them needs no restart, which
// would lose the cache.
#ifndef KVDEPOT_SERVER_TLS_H_
#define KVDEPOT_SERVER_TLS_H_

#include <grpcpp/security/server_credentials.h>
#include <grpcpp/server_context.h>

#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"

namespace kvdepot {

struct TlsOptions {
  std::string cert_path;       // PEM certificate chain of the daemon
  std::string key_path;        // PEM private key of that certificate
  std::string client_ca_path;  // PEM roots that client certificates chain to
  absl::Duration refresh = absl::Seconds(60);

  bool any() const {
    return !cert_path.empty() || !key_path.empty() || !client_ca_path.empty();
  }
};

// True for "localhost", 127.0.0.0/8 and ::1 ("host:port" or "[v6]:port").
bool IsLoopbackTarget(absl::string_view target);

// The host part of "host:port", "[v6]:port" or a bare host.
absl::string_view HostOf(absl::string_view target);

// The credentials for listening on `target` ("unix:..." or "host:port").
// INVALID_ARGUMENT when only some TLS files are given, when TLS is asked for
// on a Unix socket, or when the files are unreadable; FAILED_PRECONDITION
// when a non-loopback TCP address has no mutual TLS.
absl::StatusOr<std::shared_ptr<grpc::ServerCredentials>> ServerCredentialsFor(
    absl::string_view target, const TlsOptions& tls);

// The peer's mutual-TLS identity: the verified client certificate's subject
// as gRPC writes it (RFC 2253, e.g. "CN=worker-a,O=kv"), or "" for a peer
// without one (Unix socket, plain loopback TCP).
std::string TlsPeerSubject(const grpc::ServerContextBase& context);

}  // namespace kvdepot

#endif  // KVDEPOT_SERVER_TLS_H_
