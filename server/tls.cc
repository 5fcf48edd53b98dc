#include "server/tls.h"

#include <grpcpp/security/auth_context.h>
#include <grpcpp/security/tls_certificate_provider.h>
#include <grpcpp/security/tls_credentials_options.h>

#include <algorithm>
#include <fstream>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"

namespace kvdepot {
namespace {

absl::Status CheckReadable(absl::string_view flag, const std::string& path) {
  std::ifstream f(path);
  std::string first;
  if (!f || !std::getline(f, first)) {
    return absl::InvalidArgumentError(
        absl::StrCat(flag, ": cannot read \"", path, "\""));
  }
  if (!absl::StartsWith(first, "-----BEGIN ")) {
    return absl::InvalidArgumentError(
        absl::StrCat(flag, ": \"", path, "\" is not a PEM file"));
  }
  return absl::OkStatus();
}

}  // namespace

absl::string_view HostOf(absl::string_view target) {
  if (absl::StartsWith(target, "[")) {
    const size_t end = target.find(']');
    return end == absl::string_view::npos ? target : target.substr(1, end - 1);
  }
  const size_t colon = target.rfind(':');
  if (colon != absl::string_view::npos &&
      target.find(':') == colon) {  // one colon: host:port
    return target.substr(0, colon);
  }
  return target;
}

bool IsLoopbackTarget(absl::string_view target) {
  absl::string_view host = HostOf(target);
  if (host == "localhost" || host == "::1") return true;
  std::vector<absl::string_view> parts = absl::StrSplit(host, '.');
  if (parts.size() != 4) return false;
  for (absl::string_view p : parts) {
    int v = 0;
    if (p.empty() || p.size() > 3 || !absl::SimpleAtoi(p, &v) || v < 0 ||
        v > 255) {
      return false;
    }
  }
  return parts[0] == "127";
}

absl::StatusOr<std::shared_ptr<grpc::ServerCredentials>> ServerCredentialsFor(
    absl::string_view target, const TlsOptions& tls) {
  const bool unix_socket = absl::StartsWith(target, "unix:");
  if (!tls.any()) {
    if (unix_socket || IsLoopbackTarget(target)) {
      return grpc::InsecureServerCredentials();
    }
    return absl::FailedPreconditionError(absl::StrCat(
        "--listen=", target,
        ": refusing to serve TCP beyond loopback without mutual TLS; give "
        "--tls_cert, --tls_key and --tls_client_ca (or listen on a Unix "
        "socket or 127.0.0.1)"));
  }
  if (unix_socket) {
    return absl::InvalidArgumentError(
        "--tls_*: TLS applies to TCP listeners; a Unix socket is protected "
        "by its directory and the peer's credentials");
  }
  if (tls.cert_path.empty() || tls.key_path.empty() ||
      tls.client_ca_path.empty()) {
    return absl::InvalidArgumentError(
        "mutual TLS needs all three of --tls_cert, --tls_key and "
        "--tls_client_ca");
  }
  if (tls.refresh < absl::Seconds(1)) {
    return absl::InvalidArgumentError(
        "--tls_refresh_s must be at least 1 second");
  }
  if (absl::Status s = CheckReadable("--tls_cert", tls.cert_path); !s.ok()) {
    return s;
  }
  if (absl::Status s = CheckReadable("--tls_key", tls.key_path); !s.ok()) {
    return s;
  }
  if (absl::Status s = CheckReadable("--tls_client_ca", tls.client_ca_path);
      !s.ok()) {
    return s;
  }
  auto provider =
      std::make_shared<grpc::experimental::FileWatcherCertificateProvider>(
          tls.key_path, tls.cert_path, tls.client_ca_path,
          static_cast<unsigned int>(absl::ToInt64Seconds(tls.refresh)));
  grpc::experimental::TlsServerCredentialsOptions options(provider);
  options.watch_root_certs();
  options.watch_identity_key_cert_pairs();
  options.set_cert_request_type(
      GRPC_SSL_REQUEST_AND_REQUIRE_CLIENT_CERTIFICATE_AND_VERIFY);
  return grpc::experimental::TlsServerCredentials(options);
}

std::string TlsPeerSubject(const grpc::ServerContextBase& context) {
  const std::shared_ptr<const grpc::AuthContext> auth = context.auth_context();
  if (auth == nullptr || !auth->IsPeerAuthenticated()) return "";
  for (const grpc::string_ref& v : auth->FindPropertyValues("x509_subject")) {
    return std::string(v.data(), v.size());
  }
  return "";
}

}  // namespace kvdepot
