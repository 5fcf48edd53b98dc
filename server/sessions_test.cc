// Sessions as an attacker meets them: ids are secrets (malformed, guessed
// or expired ids are refused with a message that never contains them),
// another session's buffers can be neither used nor released nor granted
// unless granted, and leases and connection ends release everything.
#include "server/sessions.h"

#include <memory>

#include "absl/strings/str_cat.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "server/limits.h"

namespace kvdepot {
namespace {

using ::testing::HasSubstr;
using ::testing::Not;

// Memory that records its release.
class FakeMemory final : public Memory {
 public:
  FakeMemory(int64_t size, int* released) : size_(size), released_(released) {}
  ~FakeMemory() override { ++*released_; }
  uint8_t* data() const override { return nullptr; }
  int64_t size() const override { return size_; }

 private:
  int64_t size_;
  int* released_;
};

const absl::Time kT0 = absl::FromUnixSeconds(1000);

Caller MustAuth(SessionManager& m, const std::string& id,
                absl::Time now = kT0) {
  absl::StatusOr<Caller> c = m.Authenticate(id, now);
  EXPECT_TRUE(c.ok()) << c.status();
  return c.ok() ? *c : Caller{};
}

TEST(SessionsTest, LeaseRenewsAndExpiresReleasingBuffers) {
  SessionManager m(SessionLimits{});
  absl::Duration lease;
  absl::StatusOr<std::string> id = m.Open("w", absl::Seconds(2), kT0, &lease);
  ASSERT_TRUE(id.ok());
  EXPECT_EQ(lease, absl::Seconds(2));
  const Caller c = MustAuth(m, *id);
  EXPECT_FALSE(c.peer);
  EXPECT_FALSE(c.admin);
  int released = 0;
  absl::StatusOr<std::shared_ptr<Buffer>> b =
      m.AddBuffer(c, std::make_unique<FakeMemory>(100, &released));
  ASSERT_TRUE(b.ok());
  const uint64_t bid = (*b)->id;
  b->reset();
  // Renewed at t0 + 1.5 s: alive at t0 + 3 s, gone after t0 + 3.5 s.
  ASSERT_TRUE(m.Touch(*id, kT0 + absl::Milliseconds(1500)).ok());
  EXPECT_EQ(m.Reap(kT0 + absl::Seconds(3)), 0);
  EXPECT_EQ(m.Stats().buffer_bytes, 100);
  EXPECT_TRUE(m.GetBuffer(c, "buffer_id", bid).ok());
  EXPECT_EQ(m.Reap(kT0 + absl::Seconds(4)), 1);
  EXPECT_EQ(released, 1);
  EXPECT_EQ(m.Stats().sessions, 0);
  EXPECT_EQ(m.Stats().buffers, 0);
  EXPECT_EQ(m.Stats().buffer_bytes, 0);
  absl::Status s = m.GetBuffer(c, "kv.slice.buffer_id", bid).status();
  EXPECT_EQ(s.code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(std::string(s.message()), HasSubstr("kv.slice.buffer_id = 1"));
  EXPECT_EQ(m.Touch(*id, kT0 + absl::Seconds(4)).status().code(),
            absl::StatusCode::kUnauthenticated);
}

TEST(SessionsTest, IdsAreSecretsNeverEchoed) {
  SessionManager m(SessionLimits{});
  absl::StatusOr<OpenedSession> a = m.OpenPeer("a", {1, 1000, 1000});
  ASSERT_TRUE(a.ok());
  // "<number>.<32 hex>": 128 random bits after the public number.
  ASSERT_EQ(a->id.size(), absl::StrCat(a->number).size() + 1 + 32);
  absl::StatusOr<OpenedSession> b = m.OpenPeer("b", {2, 1000, 1000});
  ASSERT_TRUE(b.ok());
  EXPECT_NE(a->id.substr(2), b->id.substr(2));
  // A guess with the right number and a wrong secret, a secret one bit off,
  // malformed ids: all refused alike, never echoed.
  std::string flipped = a->id;
  flipped.back() = flipped.back() == '0' ? '1' : '0';
  const std::string guesses[] = {
      flipped,
      absl::StrCat(a->number, ".", std::string(32, '0')),
      absl::StrCat(a->number, ".", b->id.substr(b->id.find('.') + 1)),
      "feedface",
      a->id + "0",
      a->id.substr(0, a->id.size() - 1),
      absl::StrCat("0.", std::string(32, 'a')),
      absl::StrCat("99.", std::string(32, 'a')),
      std::string(5000, '1'),
  };
  for (const std::string& g : guesses) {
    absl::StatusOr<Caller> c = m.Authenticate(g, kT0);
    ASSERT_FALSE(c.ok()) << g;
    EXPECT_EQ(c.status().code(), absl::StatusCode::kUnauthenticated);
    EXPECT_THAT(std::string(c.status().message()), Not(HasSubstr(g)));
    EXPECT_THAT(std::string(c.status().message()),
                Not(HasSubstr(a->id.substr(a->id.find('.') + 1, 8))));
    EXPECT_EQ(m.Close(g).status().code(), absl::StatusCode::kUnauthenticated);
  }
  EXPECT_TRUE(m.Authenticate(a->id, kT0).ok());
  // No session at all: a Caller without one.
  absl::StatusOr<Caller> none = m.Authenticate("", kT0);
  ASSERT_TRUE(none.ok());
  EXPECT_FALSE(none->authenticated());
}

TEST(SessionsTest, AnotherSessionsBufferIsOffLimitsUntilGranted) {
  SessionManager m(SessionLimits{});
  AdminPolicy admin;
  admin.daemon_uid = 4242;
  m.set_admin_policy(admin);
  absl::StatusOr<OpenedSession> a = m.OpenPeer("a", {1, 1000, 1000});
  absl::StatusOr<OpenedSession> b = m.OpenPeer("b", {2, 1000, 1000});
  absl::StatusOr<OpenedSession> root = m.OpenPeer("r", {3, 0, 0});
  ASSERT_TRUE(a.ok() && b.ok() && root.ok());
  const Caller ca = MustAuth(m, a->id);
  const Caller cb = MustAuth(m, b->id);
  const Caller cr = MustAuth(m, root->id);
  EXPECT_TRUE(cr.admin);
  EXPECT_FALSE(ca.admin);
  int released = 0;
  absl::StatusOr<std::shared_ptr<Buffer>> buf =
      m.AddBuffer(ca, std::make_unique<FakeMemory>(64, &released));
  ASSERT_TRUE(buf.ok());
  const uint64_t id = (*buf)->id;
  buf->reset();
  // Same uid, another session; and root: neither may use, release or grant.
  for (const Caller& other : {cb, cr}) {
    EXPECT_EQ(m.GetBuffer(other, "kv.slice.buffer_id", id).status().code(),
              absl::StatusCode::kPermissionDenied);
    EXPECT_EQ(m.ReleaseBuffer(other, id).code(), absl::StatusCode::kNotFound);
    Acl self;
    self.sessions.insert(other.session);
    EXPECT_EQ(m.GrantBuffer(other, id, self).code(),
              absl::StatusCode::kPermissionDenied);
  }
  EXPECT_EQ(m.GetBuffer(Caller{}, "kv", id).status().code(),
            absl::StatusCode::kUnauthenticated);
  // The owner grants b's session: b may use it, still not release it.
  Acl grant;
  grant.sessions.insert(cb.session);
  ASSERT_TRUE(m.GrantBuffer(ca, id, grant).ok());
  EXPECT_TRUE(m.GetBuffer(cb, "kv", id).ok());
  EXPECT_EQ(m.GetBuffer(cr, "kv", id).status().code(),
            absl::StatusCode::kPermissionDenied);
  EXPECT_EQ(m.ReleaseBuffer(cb, id).code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(released, 0);
  // The connection of a ends: its buffers go with it.
  EXPECT_EQ(m.CloseNumber(a->number), 1);
  EXPECT_EQ(released, 1);
  EXPECT_EQ(m.Authenticate(a->id, kT0).status().code(),
            absl::StatusCode::kUnauthenticated);
  // Peer sessions have no lease.
  EXPECT_EQ(m.Reap(kT0 + absl::Hours(1000)), 0);
}

TEST(SessionsTest, BufferGrantsCannotGrowTheAccessListWithoutBound) {
  SessionManager m(SessionLimits{});
  absl::StatusOr<OpenedSession> a = m.OpenPeer("a", {1, 1000, 1000});
  absl::StatusOr<OpenedSession> b = m.OpenPeer("b", {2, 1001, 1001});
  ASSERT_TRUE(a.ok() && b.ok());
  const Caller ca = MustAuth(m, a->id);
  const Caller cb = MustAuth(m, b->id);
  int released = 0;
  absl::StatusOr<std::shared_ptr<Buffer>> buf =
      m.AddBuffer(ca, std::make_unique<FakeMemory>(64, &released));
  ASSERT_TRUE(buf.ok());
  const uint64_t id = (*buf)->id;
  Acl many;
  for (gid_t g = 0; g < 256; ++g) many.gids.insert(20000 + g);
  ASSERT_TRUE(m.GrantBuffer(ca, id, many).ok());  // 256 exactly
  // One more gid is refused, with b's uid in the same grant: b stays out.
  Acl more;
  more.gids.insert(30000);
  more.uids.insert(1001);
  const absl::Status s = m.GrantBuffer(ca, id, more);
  EXPECT_EQ(s.code(), absl::StatusCode::kResourceExhausted) << s;
  EXPECT_THAT(std::string(s.message()),
              HasSubstr(absl::StrCat("buffer_id = ", id,
                                     ": its access list would hold 257 "
                                     "gids, more than 256")));
  EXPECT_EQ(LimitOf(s), Limit::kAclEntries);
  EXPECT_EQ(m.GetBuffer(cb, "kv", id).status().code(),
            absl::StatusCode::kPermissionDenied);
  // 64 TLS subjects at most in all, across grants.
  Acl subjects;
  for (int i = 0; i < 64; ++i)
    subjects.tls_subjects.insert(absl::StrCat("CN=w", i));
  ASSERT_TRUE(m.GrantBuffer(ca, id, subjects).ok());
  Acl one;
  one.tls_subjects.insert("CN=extra");
  EXPECT_THAT(std::string(m.GrantBuffer(ca, id, one).message()),
              HasSubstr("would hold 65 tls_subjects, more than 64"));
  more.gids.clear();
  ASSERT_TRUE(m.GrantBuffer(ca, id, more).ok());
  EXPECT_TRUE(m.GetBuffer(cb, "kv", id).ok());
}

TEST(SessionsTest, ABufferInUseOutlivesItsRelease) {
  SessionManager m(SessionLimits{});
  absl::Duration lease;
  absl::StatusOr<std::string> id =
      m.Open("w", absl::ZeroDuration(), kT0, &lease);
  ASSERT_TRUE(id.ok());
  EXPECT_EQ(lease, SessionLimits{}.default_lease);
  const Caller c = MustAuth(m, *id);
  int released = 0;
  absl::StatusOr<std::shared_ptr<Buffer>> b =
      m.AddBuffer(c, std::make_unique<FakeMemory>(8, &released));
  ASSERT_TRUE(b.ok());
  ASSERT_TRUE(m.ReleaseBuffer(c, (*b)->id).ok());
  EXPECT_EQ(released, 0);  // still held by `b`
  b->reset();
  EXPECT_EQ(released, 1);
  EXPECT_EQ(m.ReleaseBuffer(c, 77).code(), absl::StatusCode::kNotFound);
}

TEST(SessionsTest, CloseLimitsAndClampedLeases) {
  SessionLimits limits;
  limits.max_sessions = 1;
  limits.max_buffers_per_session = 1;
  limits.max_lease = absl::Seconds(5);
  SessionManager m(limits);
  absl::Duration lease;
  absl::StatusOr<std::string> id = m.Open("w", absl::Hours(1), kT0, &lease);
  ASSERT_TRUE(id.ok());
  EXPECT_EQ(lease, absl::Seconds(5));
  EXPECT_EQ(m.Open("x", absl::ZeroDuration(), kT0, &lease).status().code(),
            absl::StatusCode::kResourceExhausted);
  EXPECT_EQ(m.Open("x", absl::Seconds(-1), kT0, &lease).status().code(),
            absl::StatusCode::kInvalidArgument);
  const Caller c = MustAuth(m, *id);
  int released = 0;
  ASSERT_TRUE(m.AddBuffer(c, std::make_unique<FakeMemory>(8, &released)).ok());
  EXPECT_EQ(m.AddBuffer(c, std::make_unique<FakeMemory>(8, &released))
                .status()
                .code(),
            absl::StatusCode::kResourceExhausted);
  EXPECT_EQ(released, 1);  // the refused one
  absl::StatusOr<int64_t> closed = m.Close(*id);
  ASSERT_TRUE(closed.ok());
  EXPECT_EQ(*closed, 1);
  EXPECT_EQ(released, 2);
  EXPECT_EQ(m.Close(*id).status().code(), absl::StatusCode::kUnauthenticated);
}

// Client names are bounded (an 8 MiB name once cost 875 MiB), and the
// refusal quotes at most 64 escaped bytes of it; one uid cannot take every
// session.
TEST(SessionsTest, ClientNameAndSessionsPerUidAreBounded) {
  SessionLimits limits;
  limits.max_sessions_per_uid = 3;
  SessionManager m(limits);
  PeerCredentials alice{.pid = 10, .uid = 1000, .gid = 1000};
  PeerCredentials bob{.pid = 11, .uid = 1001, .gid = 1001};
  const std::string huge = std::string(8 << 20, 'n') + "\nforged";
  absl::StatusOr<OpenedSession> s = m.OpenPeer(huge, alice);
  EXPECT_EQ(s.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(s.status().message()),
              HasSubstr("client_name = \"nnnn"));
  EXPECT_THAT(std::string(s.status().message()), HasSubstr("more than 256"));
  EXPECT_LT(s.status().message().size(), 256u);
  absl::Duration granted;
  EXPECT_EQ(
      m.Open(huge, absl::ZeroDuration(), absl::Now(), &granted).status().code(),
      absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(m.OpenPeer(std::string(256, 'x'), alice).ok());
  EXPECT_TRUE(m.OpenPeer("w", alice).ok());
  absl::StatusOr<OpenedSession> third = m.OpenPeer("w", alice);
  ASSERT_TRUE(third.ok());
  s = m.OpenPeer("w", alice);
  EXPECT_EQ(s.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_THAT(std::string(s.status().message()),
              HasSubstr("uid 1000 already has 3 sessions (at most 3 per uid)"));
  EXPECT_TRUE(m.OpenPeer("w", bob).ok());  // another uid is not affected
  m.CloseNumber(third->number);            // closing frees a slot
  EXPECT_TRUE(m.OpenPeer("w", alice).ok());
  EXPECT_EQ(m.Stats().sessions, 4);
}

// Anonymous sessions (OpenSession; plain loopback TCP streams) name
// nobody: together they are one client, so anyone who can reach the
// socket cannot take every session (4096) from the workers.
TEST(SessionsTest, AnonymousSessionsTogetherAreOneClient) {
  SessionLimits limits;
  limits.max_sessions_per_uid = 3;
  SessionManager m(limits);
  absl::Duration granted;
  absl::StatusOr<std::string> first =
      m.Open("a", absl::ZeroDuration(), kT0, &granted);
  ASSERT_TRUE(first.ok());
  ASSERT_TRUE(m.Open("b", absl::ZeroDuration(), kT0, &granted).ok());
  ASSERT_TRUE(m.OpenStream("c", "").ok());  // plain loopback TCP
  absl::StatusOr<std::string> s =
      m.Open("d", absl::ZeroDuration(), kT0, &granted);
  EXPECT_EQ(s.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_THAT(std::string(s.status().message()),
              HasSubstr("already 3 anonymous sessions (at most 3 together)"));
  EXPECT_EQ(LimitOf(s.status()), Limit::kSessionsPerClient);
  EXPECT_EQ(m.OpenStream("e", "").status().code(),
            absl::StatusCode::kResourceExhausted);
  // Workers and TLS clients are not affected; closing frees a slot.
  EXPECT_TRUE(m.OpenPeer("w", {.pid = 10, .uid = 1000, .gid = 1000}).ok());
  EXPECT_TRUE(m.OpenStream("t", "CN=scheduler").ok());
  ASSERT_TRUE(m.Close(*first).ok());
  EXPECT_TRUE(m.Open("d", absl::ZeroDuration(), kT0, &granted).ok());
}

}  // namespace
}  // namespace kvdepot

namespace kvdepot {
namespace {

// A TCP stream session: identified by its TLS subject (admin by subject),
// no lease (Reap never ends it, CloseNumber does), bounded per subject and
// in the length of the subject; the limits are tagged for the metrics.
TEST(SessionsTest, StreamSessionsCarryTheirSubjectAndNoLease) {
  SessionLimits limits;
  limits.max_sessions_per_uid = 2;
  SessionManager m(limits);
  AdminPolicy admin;
  admin.tls_subjects.insert("CN=ops");
  m.set_admin_policy(admin);
  absl::StatusOr<OpenedSession> a = m.OpenStream("w", "CN=worker-a");
  ASSERT_TRUE(a.ok()) << a.status();
  Caller c = MustAuth(m, a->id);
  EXPECT_EQ(c.tls_subject, "CN=worker-a");
  EXPECT_FALSE(c.peer);
  EXPECT_FALSE(c.admin);
  EXPECT_FALSE(c.anonymous());
  absl::StatusOr<OpenedSession> ops = m.OpenStream("o", "CN=ops");
  ASSERT_TRUE(ops.ok());
  EXPECT_TRUE(MustAuth(m, ops->id).admin);
  absl::StatusOr<OpenedSession> anon = m.OpenStream("x", "");
  ASSERT_TRUE(anon.ok());
  EXPECT_TRUE(MustAuth(m, anon->id).anonymous());
  // No lease: years later it is still there; KeepAlive reports none.
  const absl::Time later = kT0 + absl::Hours(24 * 365);
  EXPECT_EQ(m.Reap(later), 0);
  EXPECT_TRUE(m.Authenticate(a->id, later).ok());
  absl::StatusOr<absl::Duration> lease = m.Touch(a->id, later);
  ASSERT_TRUE(lease.ok());
  EXPECT_EQ(*lease, absl::InfiniteDuration());
  // Sessions per subject are bounded; another subject is not affected.
  ASSERT_TRUE(m.OpenStream("w", "CN=worker-a").ok());
  absl::StatusOr<OpenedSession> third = m.OpenStream("w", "CN=worker-a");
  EXPECT_EQ(third.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_EQ(LimitOf(third.status()), Limit::kSessionsPerClient);
  EXPECT_THAT(std::string(third.status().message()), HasSubstr("CN=worker-a"));
  EXPECT_TRUE(m.OpenStream("w", "CN=worker-b").ok());
  // A subject longer than kMaxTlsSubjectBytes is refused.
  absl::StatusOr<OpenedSession> huge =
      m.OpenStream("w", std::string(kMaxTlsSubjectBytes + 1, 'x'));
  EXPECT_EQ(huge.status().code(), absl::StatusCode::kInvalidArgument);
  // The stream's end ends it.
  const int64_t before = m.Stats().sessions;
  EXPECT_EQ(m.CloseNumber(a->number), 0);
  EXPECT_EQ(m.Stats().sessions, before - 1);
  EXPECT_EQ(m.Authenticate(a->id, kT0).status().code(),
            absl::StatusCode::kUnauthenticated);
}

// Access lists by subject: a TLS session is let in by its subject or by an
// anonymous grant; a peer is not let in by a subject.
TEST(SessionsTest, AclsMatchTlsSubjects) {
  Acl acl;
  acl.tls_subjects.insert("CN=b");
  Caller b{.session = 7, .tls_subject = "CN=b"};
  Caller c{.session = 8, .tls_subject = "CN=c"};
  Caller peer{.session = 9, .peer = true, .uid = 1000, .gid = 1000};
  EXPECT_TRUE(acl.Allows(b));
  EXPECT_FALSE(acl.Allows(c));
  EXPECT_FALSE(acl.Allows(peer));
  acl.anonymous = true;
  EXPECT_TRUE(acl.Allows(c));
  EXPECT_FALSE(acl.Allows(peer));
  const Owner owner{.uid = 1000, .tls_subject = "CN=b"};
  EXPECT_TRUE(owner.Is(b));
  EXPECT_FALSE(owner.Is(c));
  EXPECT_FALSE(owner.Is(peer)) << "a subject-owned object is no uid's";
  EXPECT_FALSE(CheckTlsSubject("f", "").ok());
  EXPECT_FALSE(CheckTlsSubject("f", std::string(1025, 'x')).ok());
  EXPECT_TRUE(CheckTlsSubject("f", "CN=b").ok());
}

}  // namespace
}  // namespace kvdepot
