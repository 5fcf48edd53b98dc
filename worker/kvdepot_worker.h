/* The worker's side of kvdepot's decode step path (SPEC §10,
 * docs/STEP_PATH.md), as a C ABI: libkvdepot_worker.so for C, C++ and
 * Python (ctypes; pass a torch stream's raw handle, stream.cuda_stream).
 *
 * A worker maps the doorbell region it registered (a daemon-allocated
 * buffer handed over as a CUDA VMM descriptor on the companion socket) and
 * orders its stream against the daemon's with 64-bit constant flags:
 *
 *   kvd_step_begin(w, s)     a tiny kernel bumps the device step counter
 *                            and writes the step-id word, then marks the
 *                            begin phase
 *   kvd_wait(w, s, KVD_BEGIN)            the SWA decode index is ready
 *   per layer l:
 *     ... produce K/V and indexer keys of layer l ...
 *     kvd_mark(w, s, kvd_phase_a(l))     daemon stores them
 *     kvd_wait(w, s, kvd_phase_a(l))     caches hold layer l
 *     ... indexer: top-k of layer l ...
 *     kvd_mark(w, s, kvd_phase_b(l))     daemon converts top-k to slots
 *     kvd_wait(w, s, kvd_phase_b(l))     index rows ready; attention
 *
 * Every call only enqueues work on `stream` (a cudaStream_t): all of it
 * can be captured into a CUDA graph and replayed; the step id comes from
 * the device counter, never from the capture. Nothing polls.
 *
 * Safety: kvd_worker_open refuses to run unless CUDA_MODULE_LOADING=EAGER
 * and CUDA_DEVICE_MAX_CONNECTIONS is unset or >= 8 (GPU_HOST.md hazards).
 * A watchdog thread releases the worker's own waits with memory writes
 * (from a control stream) when a begun step is not finished by the daemon
 * within watchdog_ms (the daemon died, or the step request never came);
 * every later call then returns KVD_ERR_RELEASED and kvd_status reports
 * KVD_STATUS_WORKER_WATCHDOG.
 *
 * Return values: 0 on success, a negative KVD_ERR_* otherwise;
 * kvd_last_error() describes the calling thread's last failure. The driver
 * is reached through cudaGetDriverEntryPointByVersion (no -lcuda). */
#ifndef KVDEPOT_WORKER_KVDEPOT_WORKER_H_
#define KVDEPOT_WORKER_KVDEPOT_WORKER_H_

#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#define KVD_OK 0
#define KVD_ERR_INVALID (-1)     /* a bad argument */
#define KVD_ERR_ENVIRONMENT (-2) /* EAGER loading / connections not set */
#define KVD_ERR_CUDA (-3)        /* a CUDA call failed */
#define KVD_ERR_RELEASED (-4)    /* the watchdog released this worker */

/* Sticky status bits (proto/step_doorbell.h). */
#define KVD_STATUS_STEP_MISMATCH 1u
#define KVD_STATUS_CANCELLED 2u
#define KVD_STATUS_OUT_OF_RANGE 4u
#define KVD_STATUS_WORKER_WATCHDOG 8u
#define KVD_STATUS_DAEMON_ERROR 16u

#define KVD_BEGIN 0
static inline int kvd_phase_a(int layer) { return 1 + 2 * layer; }
static inline int kvd_phase_b(int layer) { return 2 + 2 * layer; }

typedef struct kvd_worker kvd_worker;
typedef struct kvd_mapping kvd_mapping;

/* Maps the doorbell: `fd` (borrowed; the caller closes it) of `fd_size`
 * bytes (the companion reply's fd_size) on `device`, for `num_layers`
 * layers. watchdog_ms: how long a begun step may stay unfinished by the
 * daemon before the worker releases itself (0 = 10000). */
int kvd_worker_open(int fd, int64_t fd_size, int device, int num_layers,
                    int64_t watchdog_ms, kvd_worker** out);
/* Stops the watchdog and unmaps. REQUIRES: the worker's streams finished
 * the enqueued waits (or were released). */
void kvd_worker_close(kvd_worker* w);

int kvd_step_begin(kvd_worker* w, void* stream);
int kvd_mark(kvd_worker* w, void* stream, int phase);
int kvd_wait(kvd_worker* w, void* stream, int phase);

/* Reads the doorbell's header on the host (a copy on the worker's control
 * stream; waits for that copy only). Any pointer may be NULL. */
int kvd_status(kvd_worker* w, uint64_t* status_bits, uint64_t* out_of_range,
               uint64_t* step_counter, uint64_t* daemon_done);

/* The doorbell's device address (for tests and custom kernels). */
void* kvd_doorbell_ptr(kvd_worker* w);

/* Maps a CUDA VMM descriptor (a pool or a buffer handed over on the
 * companion socket) of `size` bytes on `device`; *ptr receives the device
 * address. `fd` is borrowed. */
int kvd_map_vmm_fd(int fd, int64_t size, int device, void** ptr,
                   kvd_mapping** out);
/* Unmaps it after waiting for all of this process's work on its device
 * (cudaDeviceSynchronize): unmapping a range that a queued kernel still
 * uses would fault that kernel. NULL is ignored. */
void kvd_unmap(kvd_mapping* m);

const char* kvd_last_error(void);

#ifdef __cplusplus
}
#endif

#endif /* KVDEPOT_WORKER_KVDEPOT_WORKER_H_ */
