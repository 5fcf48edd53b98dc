"""Packing of int32 arrays and bulk data inputs (no daemon)."""

import array
import os
import struct
import unittest

import grpc

from kvdepot import KVCacheError, pack_int32, unpack_int32
from kvdepot import _address
from kvdepot._arrays import data_bytes, infer_dtype, pack_int32_2d

try:
    import numpy
except ImportError:
    numpy = None

VALUES = [0, -1, 7, 2**31 - 1, -(2**31), 133]
PACKED = struct.pack("<6i", *VALUES)


class PackTest(unittest.TestCase):

    def assertInvalid(self, text, fn, *args, **kwargs):
        with self.assertRaises(KVCacheError) as cm:
            fn(*args, **kwargs)
        self.assertEqual(cm.exception.code, grpc.StatusCode.INVALID_ARGUMENT)
        self.assertIn(text, cm.exception.message)

    def test_every_input_kind_packs_little_endian(self):
        inputs = [VALUES, tuple(VALUES), PACKED, bytearray(PACKED),
                  memoryview(PACKED), array.array("i", VALUES),
                  array.array("q", VALUES), memoryview(array.array("l", VALUES))]
        for value in inputs:
            with self.subTest(kind=type(value).__name__):
                self.assertEqual(pack_int32(value, "x"), (PACKED, 6, None))
        self.assertEqual(pack_int32(range(3), "x")[0], struct.pack("<3i", 0, 1, 2))
        self.assertEqual(list(unpack_int32(PACKED)), VALUES)
        self.assertEqual(pack_int32([], "x"), (b"", 0, None))

    def test_rows(self):
        data, rows, cols = pack_int32_2d([[1, 2, 3], [4, 5, 6]], "t")
        self.assertEqual((data, rows, cols),
                         (struct.pack("<6i", 1, 2, 3, 4, 5, 6), 2, 3))
        self.assertEqual(pack_int32_2d([1, 2, 3, 4], "t", rows=2)[1:], (2, 2))
        self.assertEqual(pack_int32_2d([1, 2, 3, 4], "t", cols=4)[1:], (1, 4))
        self.assertEqual(pack_int32_2d([], "t", rows=3)[1:], (3, 0))
        self.assertEqual(pack_int32_2d([], "t", cols=4)[1:], (0, 4))

    def test_errors_name_the_field_and_index(self):
        self.assertInvalid("x[3] = 2147483648 does not fit int32",
                           pack_int32, [0, 1, 2, 2**31], "x")
        self.assertInvalid("x[0] = -2147483649 does not fit int32",
                           pack_int32, [-(2**31) - 1], "x")
        self.assertInvalid("x[1] = 2.0 is not an integer",
                           pack_int32, [1, 2.0], "x")
        self.assertInvalid("x[0] = True is not an integer",
                           pack_int32, [True], "x")
        self.assertInvalid("x: 7 bytes is not a whole number",
                           pack_int32, bytes(7), "x")
        self.assertInvalid("x: array typecode 'd' is not an integer type",
                           pack_int32, array.array("d", [1.0]), "x")
        self.assertInvalid("x[1] = 4294967295 does not fit int32",
                           pack_int32, array.array("I", [0, 2**32 - 1]), "x")
        self.assertInvalid("x: str is not an int32 array",
                           pack_int32, "12", "x")
        self.assertInvalid("t[1] has 1 columns, t[0] has 2",
                           pack_int32_2d, [[1, 2], [3]], "t")
        self.assertInvalid("t has 3 values, not a multiple of 2 rows",
                           pack_int32_2d, [1, 2, 3], "t", rows=2)
        self.assertInvalid("t has 3 columns, expected 4",
                           pack_int32_2d, [[1, 2, 3]], "t", cols=4)
        self.assertInvalid("t has 2 rows of 2, expected 1",
                           pack_int32_2d, [[1, 2], [3, 4]], "t", rows=1)
        self.assertInvalid("t: pass a 2-D array",
                           pack_int32_2d, [1, 2], "t")

    def test_data_bytes_and_dtype(self):
        self.assertEqual(data_bytes(bytearray(b"ab"), "kv"), b"ab")
        self.assertEqual(data_bytes(array.array("H", [1, 2]), "kv"),
                         array.array("H", [1, 2]).tobytes())
        self.assertEqual(infer_dtype(array.array("f", [1.0]), "kv"), "fp32")
        self.assertEqual(infer_dtype(array.array("H", [1]), "kv"), "bf16")
        self.assertEqual(infer_dtype(b"\0\0", "kv"), "bf16")
        self.assertInvalid("kv: array typecode 'd'",
                           infer_dtype, array.array("d", [1.0]), "kv")
        self.assertInvalid("kv: list is not bytes-like",
                           data_bytes, [1, 2], "kv")

    def test_default_address(self):
        saved = os.environ.get("XDG_RUNTIME_DIR")
        try:
            os.environ["XDG_RUNTIME_DIR"] = "/run/user/7"
            self.assertEqual(_address.resolve_target(""),
                             "unix:/run/user/7/kvdepot/kvdepotd.sock")
            os.environ["XDG_RUNTIME_DIR"] = "relative"
            self.assertEqual(_address.default_socket_path(),
                             f"/tmp/kvdepot-{os.getuid()}/kvdepotd.sock")
            del os.environ["XDG_RUNTIME_DIR"]
            self.assertEqual(_address.default_socket_path(),
                             f"/tmp/kvdepot-{os.getuid()}/kvdepotd.sock")
        finally:
            if saved is not None:
                os.environ["XDG_RUNTIME_DIR"] = saved
        self.assertEqual(_address.resolve_target("/a.sock"), "unix:/a.sock")
        saved_addr = os.environ.get("KVDEPOT_ADDR")
        try:
            os.environ["KVDEPOT_ADDR"] = "/env.sock"
            self.assertEqual(_address.resolve_target(""), "unix:/env.sock")
            self.assertEqual(_address.resolve_target("/flag.sock"),
                             "unix:/flag.sock")
            os.environ["KVDEPOT_ADDR"] = ""
            self.assertTrue(_address.resolve_target("").endswith(
                "/kvdepotd.sock"))
        finally:
            if saved_addr is None:
                os.environ.pop("KVDEPOT_ADDR", None)
            else:
                os.environ["KVDEPOT_ADDR"] = saved_addr
        self.assertEqual(_address.resolve_target("unix:/a"), "unix:/a")
        self.assertEqual(_address.resolve_target("h:9"), "h:9")

    @unittest.skipIf(numpy is None, "NumPy is not installed")
    def test_numpy(self):
        for dtype in ("int32", "int64", ">i4", "uint16"):
            with self.subTest(dtype=dtype):
                a = numpy.array([[0, 7], [133, 5]], dtype=dtype)
                self.assertEqual(pack_int32(a, "x"),
                                 (struct.pack("<4i", 0, 7, 133, 5), 4, 2))
        self.assertInvalid("x[2] = 2147483648 does not fit int32", pack_int32,
                           numpy.array([0, 1, 2**31], dtype=numpy.int64), "x")
        self.assertInvalid("x[1] = 4294967295 does not fit int32", pack_int32,
                           numpy.array([0, 2**32 - 1], dtype=numpy.uint32), "x")
        self.assertInvalid("x: NumPy dtype float32 is not an integer type",
                           pack_int32, numpy.zeros(2, numpy.float32), "x")
        self.assertEqual(infer_dtype(numpy.zeros(2, numpy.float32), "kv"),
                         "fp32")
        self.assertEqual(infer_dtype(numpy.zeros(2, numpy.uint16), "kv"),
                         "bf16")
        self.assertInvalid("kv: NumPy dtype float64", infer_dtype,
                           numpy.zeros(2), "kv")
        big = numpy.array([1, 2], dtype=">u2")
        self.assertEqual(data_bytes(big, "kv"), b"\x01\x00\x02\x00")
        strided = numpy.arange(6, dtype="<u2")[::2]
        self.assertEqual(data_bytes(strided, "kv"),
                         struct.pack("<3H", 0, 2, 4))


if __name__ == "__main__":
    unittest.main()
