#include "server/tls_test_certs.h"

#include <cstdlib>
#include <fstream>
#include <sstream>

#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"

namespace kvdepot::testing {
namespace {

void Run(const std::string& cmd) {
  EXPECT_EQ(std::system((cmd + " 2>/dev/null").c_str()), 0) << cmd;
}

}  // namespace

std::string CertDir() { return std::getenv("TEST_TMPDIR"); }

std::string ReadFile(const std::string& path) {
  std::ifstream f(path);
  std::stringstream s;
  s << f.rdbuf();
  return s.str();
}

void MakeCa(const std::string& ca) {
  Run(absl::StrCat("cd ", CertDir(),
                   " && openssl req -x509 -newkey ec -pkeyopt ",
                   "ec_paramgen_curve:prime256v1 -nodes -keyout ", ca,
                   ".key -out ", ca, ".pem -days 2 -subj /CN=", ca));
}

void MakeCert(const std::string& ca, const std::string& name,
              const std::string& cn) {
  std::ofstream(CertDir() + "/san.ext")
      << "subjectAltName=IP:127.0.0.1,DNS:localhost\n";
  Run(absl::StrCat(
      "cd ", CertDir(), " && openssl req -newkey ec -pkeyopt ",
      "ec_paramgen_curve:prime256v1 -nodes -keyout ", name, ".key.new -out ",
      name, ".csr -subj /CN=", cn, " && openssl x509 -req -in ", name,
      ".csr -CA ", ca, ".pem -CAkey ", ca, ".key -CAcreateserial -out ", name,
      ".pem.new -days 2 -extfile san.ext", " && mv ", name, ".key.new ", name,
      ".key && mv ", name, ".pem.new ", name, ".pem"));
}

std::shared_ptr<grpc::ChannelCredentials> ClientCreds(const std::string& ca,
                                                      const std::string& name) {
  grpc::SslCredentialsOptions o;
  o.pem_root_certs = ReadFile(CertDir() + "/" + ca + ".pem");
  if (!name.empty()) {
    o.pem_private_key = ReadFile(CertDir() + "/" + name + ".key");
    o.pem_cert_chain = ReadFile(CertDir() + "/" + name + ".pem");
  }
  return grpc::SslCredentials(o);
}

}  // namespace kvdepot::testing
