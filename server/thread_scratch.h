// Per-thread scratch for the request handlers: decoded arrays, snapshots
// of shared buffers and plan builders keep their capacity from one call to
// the next on the same thread, so steady-state calls do not allocate.
//
// What the threads keep between calls is bounded whatever clients send:
// kept scratch counts against kScratchKeptBytes (all threads together) and
// kScratchKeptPerThreadBytes (one scratch object). A call that left its
// thread's scratch larger than its share frees it when the call ends, so
// the next call on that thread starts empty. Without this a client sending
// a few requests at --max_array_elements per field (a 60 MB block table
// makes a 240 MB plan) left each handler thread holding what its largest
// call needed, for good: 3.5 GB after 24 BuildPlan calls on a small VM.
//
// Use:
//   struct MyScratch { std::vector<int32_t> a; ... };
//   int64_t HeldBytes(const MyScratch& s) { return CapacityBytes(s.a, ...); }
//   ThreadScratch<MyScratch> sc;  // for the whole call
//   sc->a.resize(n);
#ifndef KVDEPOT_SERVER_THREAD_SCRATCH_H_
#define KVDEPOT_SERVER_THREAD_SCRATCH_H_

#include <cstdint>
#include <memory>

namespace kvdepot {

inline constexpr int64_t kScratchKeptBytes = int64_t{256} << 20;
inline constexpr int64_t kScratchKeptPerThreadBytes = int64_t{64} << 20;

// The bytes of each container's allocated capacity, summed.
template <class... C>
int64_t CapacityBytes(const C&... c) {
  return (int64_t{0} + ... +
          static_cast<int64_t>(c.capacity() * sizeof(typename C::value_type)));
}

namespace scratch_internal {

// Moves a thread's kept bytes from *kept to `bytes` when that fits both
// bounds (true); otherwise gives *kept back, sets it to 0 and returns false
// (the caller frees its scratch).
bool Keep(int64_t* kept, int64_t bytes);
// Gives back bytes a thread kept (its scratch is freed).
void Drop(int64_t* kept);

}  // namespace scratch_internal

// Scratch kept by all threads between calls, in bytes (tests, metrics).
int64_t ScratchKeptBytes();

// The calling thread's S for the lifetime of this object (one call).
// HeldBytes(const S&) (found by argument-dependent lookup) says what the
// object holds. A nested ThreadScratch<S> on the same thread gets a fresh
// S of its own, freed when it ends.
template <class S>
class ThreadScratch {
 public:
  ThreadScratch() {
    Slot& slot = ThisThread();
    if (slot.in_use) {
      own_ = std::make_unique<S>();
      s_ = own_.get();
      return;
    }
    if (slot.s == nullptr) slot.s = std::make_unique<S>();
    slot.in_use = true;
    slot_ = &slot;
    s_ = slot.s.get();
  }
  ~ThreadScratch() {
    if (slot_ == nullptr) return;
    slot_->in_use = false;
    if (!scratch_internal::Keep(&slot_->kept, HeldBytes(*s_))) {
      slot_->s.reset();
    }
  }
  ThreadScratch(const ThreadScratch&) = delete;
  ThreadScratch& operator=(const ThreadScratch&) = delete;

  S& operator*() const { return *s_; }
  S* operator->() const { return s_; }

 private:
  struct Slot {
    std::unique_ptr<S> s;
    int64_t kept = 0;
    bool in_use = false;
    ~Slot() { scratch_internal::Drop(&kept); }  // the thread exits
  };
  static Slot& ThisThread() {
    thread_local Slot slot;
    return slot;
  }

  Slot* slot_ = nullptr;    // null: a nested use with its own S
  std::unique_ptr<S> own_;  // that S
  S* s_ = nullptr;
};

}  // namespace kvdepot

#endif  // KVDEPOT_SERVER_THREAD_SCRATCH_H_
