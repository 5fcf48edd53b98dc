/* kvdepot_kernels.h is a C header: this C program (compiled as C, not C++)
 * creates a layout, stores two BF16 tokens into a BF16(8) pool and loads
 * them back bit for bit, and reads a refusal's message. */
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>

#include "libkvdepot/kvdepot_kernels.h"

#define CHECK(cond)                                                         \
  do {                                                                      \
    if (!(cond)) {                                                          \
      fprintf(stderr, "%s:%d: %s failed (%s)\n", __FILE__, __LINE__, #cond, \
              kvdk_last_error());                                           \
      return 1;                                                             \
    }                                                                       \
  } while (0)

int main(void) {
  /* The struct layouts kvdepot_kernels.py declares (capi_smoke_test checks
   * the same numbers on the ctypes side). */
  CHECK(sizeof(kvdk_format_desc) == 32);
  CHECK(sizeof(kvdk_layout_info) == 23 * 8);
  CHECK(KVDK_LAYOUT_INFO_V1_BYTES == 22 * 8);
  CHECK(offsetof(kvdk_layout_info, num_slots) == 21 * 8);
  CHECK(offsetof(kvdk_layout_info, tail_bytes) == 22 * 8);
  CHECK(sizeof(kvdk_fused_params) == 64);
  CHECK(offsetof(kvdk_fused_params, norm_weight) == 8);
  CHECK(offsetof(kvdk_fused_params, eps) == 16);
  CHECK(offsetof(kvdk_fused_params, positions) == 32);
  CHECK(offsetof(kvdk_fused_params, max_position) == 48);
  CHECK(offsetof(kvdk_fused_params, hadamard_len) == 60);
  kvdk_layout* layout = NULL;
  CHECK(kvdk_layout_create("BF16", 8, 3, 2, 1, &layout) == KVDK_OK);
  kvdk_layout_info info;
  CHECK(kvdk_layout_get_info(layout, &info, sizeof(info)) == KVDK_OK);
  CHECK(info.bytes_per_token == 16 && info.block_stride == 64);
  CHECK(info.total_bytes == 256);
  uint8_t pool[256];
  memset(pool, 0, sizeof(pool));
  uint16_t kv[16];
  for (int i = 0; i < 16; ++i) kv[i] = (uint16_t)(0x3F80 + i); /* BF16 */
  const int32_t slots[2] = {5, 0};
  CHECK(kvdk_store_cpu(layout, pool, sizeof(pool), 0, kv, KVDK_DTYPE_BF16,
                       slots, 2) == KVDK_OK);
  const int32_t segments[8] = {1, 2, 3, 0, 0, 0, 1, 1}; /* slots 5, 0 */
  uint16_t out[16];
  CHECK(kvdk_load_cpu(layout, pool, sizeof(pool), 0, segments, 2, 2, out,
                      sizeof(out), NULL, 0) == KVDK_OK);
  CHECK(memcmp(out, kv, sizeof(kv)) == 0);
  const int32_t bad[1] = {6};
  CHECK(kvdk_store_cpu(layout, pool, sizeof(pool), 0, kv, KVDK_DTYPE_BF16, bad,
                       1) == KVDK_ERR_INVALID);
  CHECK(strstr(kvdk_last_error(), "slot_mapping[0] = 6") != NULL);
  kvdk_layout_destroy(layout);
  printf("capi_c_test: OK\n");
  return 0;
}
