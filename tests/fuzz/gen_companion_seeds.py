"""Seeds of //tests/fuzz:companion_fuzz. Each message of an input is one
attach byte (bits 0-1: how many descriptors; then 2 bits per descriptor:
0 sealed memfd of the declared size, 1 pipe, 2 unsealed memfd, 3 the last
descriptor the daemon handed out), a 3-byte big-endian length and the
message bytes (a CompanionRequest, hand-encoded here so that no protobuf
module is needed). Run: python3 tests/fuzz/gen_companion_seeds.py
tests/fuzz/corpus/companion_fuzz
"""
import os
import sys


def varint(v):
    v &= (1 << 64) - 1
    out = b''
    while True:
        b = v & 0x7f
        v >>= 7
        if v:
            out += bytes([b | 0x80])
        else:
            return out + bytes([b])


def field(num, wire, payload):
    key = varint((num << 3) | wire)
    if wire == 2:
        return key + varint(len(payload)) + payload
    return key + payload


def hello(name=b'fuzz'):
    return field(1, 2, field(1, 2, name))


def map_pool(name=b'p'):
    return field(2, 2, field(1, 2, name))


def allocate(size):
    return field(3, 2, field(2, 0, varint(size)))


def import_buffer(size):
    return field(4, 2, field(1, 0, varint(size)))


def msg(body, attach=0):
    return bytes([attach]) + len(body).to_bytes(3, 'big') + body


def fds(*kinds):
    a = len(kinds)
    for i, k in enumerate(kinds):
        a |= k << (2 + 2 * i)
    return a


seeds = {
    'session_map_allocate_import': msg(hello()) + msg(map_pool()) +
    msg(allocate(4096)) + msg(import_buffer(4096), fds(0)),
    'imports_not_memfds': msg(hello()) + msg(import_buffer(4096), fds(1)) +
    msg(import_buffer(4096), fds(2)),
    'daemon_memory_handed_back': msg(hello()) + msg(map_pool()) +
    msg(import_buffer(4096), fds(3)) + msg(allocate(8192)) +
    msg(import_buffer(8192), fds(3)),
    'three_descriptors': msg(hello()) + msg(import_buffer(4096),
                                            fds(0, 0, 1)),
    'descriptor_on_hello': msg(hello(), fds(0)),
    'no_hello_first': msg(map_pool()) + msg(allocate(4096)),
    'garbage': msg(b'\xff\xff\xff\x0f') + msg(hello()) + msg(b'\x0a'),
    'hello_twice': msg(hello()) + msg(hello(b'again\nforged')),
    'descriptor_cap': msg(hello()) + msg(allocate(4096)) * 5 +
    msg(import_buffer(4096), fds(0)),
    'sizes': msg(hello()) + msg(allocate(0)) + msg(allocate(-1)) +
    msg(allocate(1 << 62)) + msg(import_buffer(4096 * 3), fds(0)) +
    msg(import_buffer(1 << 40), fds(0)),
    'unknown_pool_and_long_name': msg(hello(b'x' * 300)) + msg(hello()) +
    msg(map_pool(b'nope')) + msg(map_pool(b'')),
    'empty_message_closes': msg(hello()) + msg(allocate(4096)) + msg(b''),
}

out = sys.argv[1]
os.makedirs(out, exist_ok=True)
for name, data in seeds.items():
    with open(os.path.join(out, name), 'wb') as f:
        f.write(data)
