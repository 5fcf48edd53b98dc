// Test certificates made with the openssl command line in $TEST_TMPDIR:
// a CA, and key pairs signed by it (IP 127.0.0.1 and localhost as names).
#ifndef KVDEPOT_SERVER_TLS_TEST_CERTS_H_
#define KVDEPOT_SERVER_TLS_TEST_CERTS_H_

#include <grpcpp/grpcpp.h>

#include <memory>
#include <string>

namespace kvdepot::testing {

// $TEST_TMPDIR.
std::string CertDir();
// The whole file.
std::string ReadFile(const std::string& path);
// `ca`.pem / `ca`.key: a self-signed CA with common name `ca`. Adds a gtest
// failure when openssl fails.
void MakeCa(const std::string& ca);
// `name`.pem / `name`.key signed by `ca`, subject /CN=`cn` (the files are
// replaced by rename, as a rotation would).
void MakeCert(const std::string& ca, const std::string& name,
              const std::string& cn);
// Channel credentials trusting `ca`, presenting `name`'s certificate ("" =
// none).
std::shared_ptr<grpc::ChannelCredentials> ClientCreds(const std::string& ca,
                                                      const std::string& name);

}  // namespace kvdepot::testing

#endif  // KVDEPOT_SERVER_TLS_TEST_CERTS_H_
