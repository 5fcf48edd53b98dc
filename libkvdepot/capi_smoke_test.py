"""libkvdepot_kernels.so through ctypes (kvdepot_kernels.py), as the Python
reference worker loads it: no torch, no NumPy. Store BF16 tokens into a V41
layer and load them back (values exact in e4m3), a refused slot with its
message and an untouched pool, the compressed plan of SPEC §6's worked
example, convert_topk, and the CUDA entry points' refusals without a GPU."""

import ctypes
import os
import struct
import sys
import unittest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import kvdepot_kernels as K  # noqa: E402

LIB_PATH = os.environ["KVDEPOT_KERNELS_LIB"]


def bf16(x):
    """BF16 bits of a float that BF16 represents exactly."""
    return struct.unpack("<I", struct.pack("<f", x))[0] >> 16


def buf(n):
    b = (ctypes.c_uint8 * n)()
    return b, ctypes.addressof(b)


def int32s(values):
    a = (ctypes.c_int32 * len(values))(*values)
    return a, ctypes.addressof(a)


class SignaturesTest(unittest.TestCase):
    """kvdepot_kernels.py declares every function of the header, with the
    header's number of arguments and return type."""

    def test_signatures_match_the_header(self):
        import re
        here = os.path.dirname(os.path.abspath(__file__))
        with open(os.path.join(here, "kvdepot_kernels.h")) as f:
            text = re.sub(r"/\*.*?\*/", "", f.read(), flags=re.S)
        protos = re.findall(
            r"^((?:const )?[a-z0-9_]+\*?)\s+\*?(kvdk_\w+)\(([^)]*)\);",
            text, flags=re.M)
        self.assertGreater(len(protos), 20)
        ret = {"int": ctypes.c_int, "int64_t": ctypes.c_int64,
               "void": None, "const char*": ctypes.c_char_p}
        names = set()
        for restype, name, params in protos:
            names.add(name)
            self.assertIn(name, K.SIGNATURES)
            want_args = 0 if params.strip() == "void" else params.count(",") + 1
            got_restype, got_args = K.SIGNATURES[name]
            self.assertEqual(len(got_args), want_args, name)
            self.assertIs(got_restype, ret[restype.strip()], name)
            if want_args == 0:
                continue
            for i, (param, got) in enumerate(zip(params.split(","),
                                                 got_args)):
                where = "%s argument %d (%s)" % (name, i, param.strip())
                if "*" in param:
                    self.assertTrue(
                        got in (ctypes.c_void_p, ctypes.c_char_p)
                        or issubclass(got, ctypes._Pointer), where)
                elif "int32_t" in param:
                    self.assertIs(got, ctypes.c_int32, where)
                elif "int64_t" in param:
                    self.assertIs(got, ctypes.c_int64, where)
                else:
                    self.fail("unexpected parameter type: " + where)
        self.assertEqual(names, set(K.SIGNATURES))

    def test_struct_layouts(self):
        # The same numbers capi_c_test checks with sizeof/offsetof in C.
        self.assertEqual(ctypes.sizeof(K.FormatDesc), 32)
        self.assertEqual(ctypes.sizeof(K.LayoutInfo), 23 * 8)
        self.assertEqual(K.LayoutInfo.num_slots.offset, 21 * 8)
        self.assertEqual(K.LayoutInfo.tail_bytes.offset, 22 * 8)
        self.assertEqual(ctypes.sizeof(K.FusedParams), 64)
        self.assertEqual(K.FusedParams.norm_weight.offset, 8)
        self.assertEqual(K.FusedParams.eps.offset, 16)
        self.assertEqual(K.FusedParams.positions.offset, 32)
        self.assertEqual(K.FusedParams.max_position.offset, 48)
        self.assertEqual(K.FusedParams.hadamard_len.offset, 60)


class SmokeTest(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.lib = K.load(LIB_PATH)

    def layout(self, name, block_size, num_blocks, num_layers, elements=0):
        h = ctypes.c_void_p()
        K.check(self.lib, self.lib.kvdk_layout_create(
            name, elements, block_size, num_blocks, num_layers,
            ctypes.byref(h)))
        self.addCleanup(self.lib.kvdk_layout_destroy, h)
        info = K.LayoutInfo()
        K.check(self.lib, self.lib.kvdk_layout_get_info(
            h, ctypes.byref(info), ctypes.sizeof(info)))
        return h, info

    def test_layout_matches_spec(self):
        h, info = self.layout(b"V41", 7, 3, 2)
        self.assertEqual(info.bytes_per_token, 528)
        # round_up(7 * 528, lcm(32, 528) = 1056)
        self.assertEqual(info.block_stride, 4224)
        self.assertEqual(info.layer_bytes, 3 * 4224)
        self.assertEqual(info.layer_stride, 12800)  # rounded up to 256
        self.assertEqual(info.total_bytes, 2 * 12800)
        self.assertEqual(info.load_data_row_bytes, 1024)
        self.assertEqual(info.num_slots, 21)
        name = ctypes.create_string_buffer(32)
        K.check(self.lib, self.lib.kvdk_layout_format_name(h, name, 32))
        self.assertEqual(name.value, b"V41")
        _, b = self.layout(b"BF16", 1, 4, 1, elements=6)
        self.assertEqual(b.bytes_per_token, 12)

    def test_store_load_round_trip(self):
        h, info = self.layout(b"V41", 7, 3, 2)
        pool, pool_ptr = buf(info.total_bytes)
        values = [0.0, 0.5, -1.0, 2.0, -0.5, 1.0]
        n = 3
        kv = (ctypes.c_uint16 * (n * 512))(
            *[bf16(values[(t * 7 + i) % 6]) for t in range(n)
              for i in range(512)])
        slots, slots_ptr = int32s([0, -1, 20])
        K.check(self.lib, self.lib.kvdk_store_cpu(
            h, pool_ptr, info.total_bytes, 1, ctypes.addressof(kv),
            K.KVDK_DTYPE_BF16, slots_ptr, n))
        self.assertEqual(bytes(pool)[:info.layer_stride],
                         bytes(info.layer_stride))  # layer 0 untouched
        # Slot 0 -> row 0, slot 20 (block 2, token 6) -> row 1.
        seg, seg_ptr = int32s([0, 0, 1, 0, 2, 6, 7, 1])
        out = (ctypes.c_uint16 * (2 * 512))()
        K.check(self.lib, self.lib.kvdk_load_cpu(
            h, pool_ptr, info.total_bytes, 1, seg_ptr, 2, 2,
            ctypes.addressof(out), ctypes.sizeof(out), None, 0))
        self.assertEqual(list(out[:512]), list(kv[:512]))
        self.assertEqual(list(out[512:]), list(kv[2 * 512:]))

    def test_bad_slot_is_refused(self):
        h, info = self.layout(b"MXFP8_INDEX", 133, 2, 1)
        pool, pool_ptr = buf(info.total_bytes)
        kv = (ctypes.c_uint16 * (2 * 128))(*([bf16(1.0)] * 256))
        slots, slots_ptr = int32s([3, 266])
        rc = self.lib.kvdk_store_cpu(h, pool_ptr, info.total_bytes, 0,
                                     ctypes.addressof(kv), 0, slots_ptr, 2)
        self.assertEqual(rc, K.KVDK_ERR_INVALID)
        self.assertIn(b"slot_mapping[1] = 266 is outside [-1, 266)",
                      self.lib.kvdk_last_error())
        self.assertEqual(bytes(pool), bytes(info.total_bytes))
        with self.assertRaises(K.KernelsError):
            K.check(self.lib, self.lib.kvdk_store_cpu(
                None, pool_ptr, info.total_bytes, 0, None, 0, None, 0))

    def test_worked_example_plan_and_topk(self):
        h, _ = self.layout(b"FP4_INDEX", 16, 1024, 1)
        seqlen, seqlen_ptr = int32s([10000])
        table, table_ptr = int32s(list(range(157)))
        seg, seg_ptr = int32s([0] * (4 * 157))
        num, total = ctypes.c_int64(), ctypes.c_int64()
        K.check(self.lib, self.lib.kvdk_build_compressed_plan(
            h, 4, seqlen_ptr, 1, table_ptr, 157, seg_ptr, 157,
            ctypes.byref(num), ctypes.byref(total), None))
        self.assertEqual((num.value, total.value), (157, 2500))
        self.assertEqual(list(seg[-4:]), [156, 0, 4, 2496])
        rc = self.lib.kvdk_build_compressed_plan(
            h, 4, seqlen_ptr, 1, table_ptr, 157, seg_ptr, 10,
            ctypes.byref(num), ctypes.byref(total), None)
        self.assertEqual(rc, K.KVDK_ERR_CAPACITY)
        self.assertEqual(num.value, 157)
        topk, topk_ptr = int32s([0, 17, 2499, 2500, -3, 5])
        valid, valid_ptr = int32s([5])
        ntok, ntok_ptr = int32s([2500])
        invalid = ctypes.c_int64(-1)
        K.check(self.lib, self.lib.kvdk_convert_topk_cpu(
            h, topk_ptr, 1, 6, valid_ptr, ntok_ptr, table_ptr, 157, 157,
            ctypes.byref(invalid)))
        self.assertEqual(list(topk), [0, 17, 156 * 16 + 3, -1, -1, -1])
        self.assertEqual(invalid.value, 2)

    def test_cuda_entry_points_refuse_on_the_host(self):
        h, info = self.layout(b"V41", 64, 4, 1)
        self.assertEqual(self.lib.kvdk_cuda_workspace_bytes(
            K.KVDK_OP_FUSED_STORE, 1), 512)
        self.assertLess(self.lib.kvdk_cuda_workspace_bytes(42, 1), 0)
        rc = self.lib.kvdk_store_cuda(h, None, info.total_bytes, 0, None, 0,
                                      None, 1, None, 0, None, None)
        if self.lib.kvdk_has_cuda():
            self.assertEqual(rc, K.KVDK_ERR_INVALID)
            self.assertIn(b"pool is null", self.lib.kvdk_last_error())
        else:
            self.assertEqual(rc, K.KVDK_ERR_UNSUPPORTED)


if __name__ == "__main__":
    unittest.main()
