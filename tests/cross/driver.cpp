// Runs kernel-library entry points in another architecture's process (aarch64 under qemu-user),
// so that the same calls the x86 tests make through ctypes run on the cross-built library and
// their outputs can be compared with the same references (tests/cross/__init__.py, used by the aarch64 cases of the kernel tests).
//
//   driver LIBRARY.so CALLS.bin OUT.bin
//
// CALLS.bin (little-endian): "YRC1", int64 buffer count, per buffer int64 size then its bytes;
// int64 call count, per call: int64 name length, the name, int64 argument count, per argument a
// kind byte and its value: 'P' int64 buffer index + int64 byte offset (a pointer into a buffer),
// 'N' (a null pointer), 'I' int64, 'F' float32; then int64 relocation count, per relocation four
// int64 (buffer, byte position, target buffer, target offset): the 8 bytes at that position hold
// the address of the target for the call's duration (a task entry point's argument block holds
// pointers) and get their old bytes back afterwards. OUT.bin: "YRO1", then every buffer as
// CALLS.bin holds them, after all calls ran in order.
//
// An entry point is called through one function type of 24 int64 and 8 float parameters: under
// the AArch64 procedure call standard (and the x86-64 System V one) integer and floating-point
// arguments are assigned to their own registers in order and integers past the eighth (sixth)
// go to 8-byte stack slots in order, so a callee with at most 24 integer/pointer and 8 float
// parameters reads exactly the values it was declared with. Every index and size read from
// CALLS.bin is checked; the driver exits 2 with a message on anything malformed.
#include <dlfcn.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

namespace {

[[noreturn]] void fail(const std::string& why) {
    std::fprintf(stderr, "driver: %s\n", why.c_str());
    std::exit(2);
}

struct Reader {
    std::vector<char> data;
    size_t at = 0;
    void need(size_t n) {
        if (n > data.size() - at) fail("CALLS.bin is truncated");
    }
    template <typename T>
    T get() {
        need(sizeof(T));
        T v;
        std::memcpy(&v, data.data() + at, sizeof(T));
        at += sizeof(T);
        return v;
    }
    int64_t i64() { return get<int64_t>(); }
    float f32() { return get<float>(); }
    char byte() {
        need(1);
        return data[at++];
    }
    std::string bytes(int64_t n) {
        if (n < 0) fail("negative length");
        need((size_t)n);
        std::string s(data.data() + at, (size_t)n);
        at += (size_t)n;
        return s;
    }
};

std::vector<char> read_file(const char* path) {
    FILE* f = std::fopen(path, "rb");
    if (!f) fail(std::string("cannot open ") + path);
    std::vector<char> out;
    char chunk[1 << 16];
    size_t n;
    while ((n = std::fread(chunk, 1, sizeof chunk, f)) > 0) out.insert(out.end(), chunk, chunk + n);
    std::fclose(f);
    return out;
}

using Universal = void (*)(int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t,
                           int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t,
                           int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t,
                           float, float, float, float, float, float, float, float);

}  // namespace

int main(int argc, char** argv) {
    if (argc != 4) fail("usage: driver LIBRARY.so CALLS.bin OUT.bin");
    void* lib = dlopen(argv[1], RTLD_NOW | RTLD_LOCAL);
    if (!lib) fail(std::string("dlopen: ") + dlerror());
    Reader r{read_file(argv[2])};
    if (r.bytes(4) != "YRC1") fail("CALLS.bin does not start with YRC1");
    const int64_t nbuf = r.i64();
    if (nbuf < 0 || nbuf > 4096) fail("bad buffer count");
    // 64-byte aligned as torch's CPU allocator's, with 64 bytes of slack after each
    std::vector<char*> bufs((size_t)nbuf);
    std::vector<int64_t> sizes((size_t)nbuf);
    for (int64_t i = 0; i < nbuf; ++i) {
        const int64_t size = r.i64();
        if (size < 0 || size > (int64_t(1) << 32)) fail("bad buffer size");
        std::string bytes = r.bytes(size);
        bufs[(size_t)i] = (char*)std::aligned_alloc(64, (size_t)((size + 127) / 64 * 64));
        if (!bufs[(size_t)i]) fail("out of memory");
        std::memcpy(bufs[(size_t)i], bytes.data(), (size_t)size);
        sizes[(size_t)i] = size;
    }
    const int64_t ncalls = r.i64();
    for (int64_t c = 0; c < ncalls; ++c) {
        const std::string name = r.bytes(r.i64());
        void* sym = dlsym(lib, name.c_str());
        if (!sym) fail("no entry point " + name);
        int64_t ints[24] = {0};
        float floats[8] = {0};
        int ni = 0, nf = 0;
        const int64_t nargs = r.i64();
        for (int64_t a = 0; a < nargs; ++a) {
            const char kind = r.byte();
            if (kind == 'F') {
                if (nf == 8) fail(name + ": more than 8 float arguments");
                floats[nf++] = r.f32();
                continue;
            }
            if (ni == 24) fail(name + ": more than 24 integer arguments");
            if (kind == 'P') {
                const int64_t idx = r.i64(), off = r.i64();
                if (idx < 0 || idx >= nbuf) fail(name + ": buffer index out of range");
                if (off < 0 || off > sizes[(size_t)idx]) fail(name + ": offset out of range");
                ints[ni++] = (int64_t)(intptr_t)(bufs[(size_t)idx] + off);
            } else if (kind == 'N') {
                ints[ni++] = 0;
            } else if (kind == 'I') {
                ints[ni++] = r.i64();
            } else {
                fail(name + ": unknown argument kind");
            }
        }
        struct Reloc {
            char* at;
            int64_t old;
        };
        std::vector<Reloc> relocs;
        const int64_t nreloc = r.i64();
        if (nreloc < 0 || nreloc > 4096) fail(name + ": bad relocation count");
        for (int64_t k = 0; k < nreloc; ++k) {
            const int64_t b = r.i64(), pos = r.i64(), t = r.i64(), off = r.i64();
            if (b < 0 || b >= nbuf || t < 0 || t >= nbuf) fail(name + ": relocation buffer out of range");
            if (pos < 0 || pos + 8 > sizes[(size_t)b] || off < 0 || off > sizes[(size_t)t])
                fail(name + ": relocation out of range");
            char* at = bufs[(size_t)b] + pos;
            int64_t old, addr = (int64_t)(intptr_t)(bufs[(size_t)t] + off);
            std::memcpy(&old, at, 8);
            std::memcpy(at, &addr, 8);
            relocs.push_back({at, old});
        }
        ((Universal)sym)(ints[0], ints[1], ints[2], ints[3], ints[4], ints[5], ints[6], ints[7], ints[8], ints[9],
                         ints[10], ints[11], ints[12], ints[13], ints[14], ints[15], ints[16], ints[17], ints[18],
                         ints[19], ints[20], ints[21], ints[22], ints[23], floats[0], floats[1], floats[2], floats[3],
                         floats[4], floats[5], floats[6], floats[7]);
        for (const Reloc& rl : relocs) std::memcpy(rl.at, &rl.old, 8);
    }
    FILE* out = std::fopen(argv[3], "wb");
    if (!out) fail(std::string("cannot write ") + argv[3]);
    std::fwrite("YRO1", 1, 4, out);
    std::fwrite(&nbuf, 8, 1, out);
    for (int64_t i = 0; i < nbuf; ++i) {
        std::fwrite(&sizes[(size_t)i], 8, 1, out);
        std::fwrite(bufs[(size_t)i], 1, (size_t)sizes[(size_t)i], out);
    }
    std::fclose(out);
    return 0;
}
