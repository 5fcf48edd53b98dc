// Marks functions callable from both host C++ and CUDA device code, so the
// byte layout and the quantization math are written exactly once.
#ifndef KVDEPOT_KERNELS_HOST_DEVICE_H_
#define KVDEPOT_KERNELS_HOST_DEVICE_H_

#if defined(__CUDACC__)
#define KV_HD __host__ __device__
#else
#define KV_HD
#endif

#endif  // KVDEPOT_KERNELS_HOST_DEVICE_H_
