/* A call runner for keel's kernel libraries built for another architecture.
 *
 * Built with the target's cross compiler and run under qemu-user, it reads a script
 * written on the host (tests/native/cross/runner.py), runs it and writes back what
 * the script asks for. It knows nothing of the kernels: the script loads libraries,
 * allocates buffers (filled or zeroed), writes buffer addresses into buffers (the
 * address fields of an argument block), calls exported functions and dumps buffers.
 *
 * Script (little-endian): "KQS1", then records, each an opcode byte:
 *   'L' u32 n, n bytes          load the library at that path (libraries numbered from 0)
 *   'B' u32 id, u64 n, u8 full  a buffer of n bytes, then n bytes of contents if full
 *   'P' u32 id, u64 at, u32 to, u64 off   store buffer `to`'s address + off at buffer id + at
 *   'C' u32 lib, u32 n, n bytes (symbol), u8 ni, ni x (u8 kind, i64 v, u32 ref),
 *       u8 nf, nf x f32            call: kind 0 passes v, 1 the address of buffer ref + v,
 *                                  2 the address of the symbol named by the next
 *                                  (u32 n, n bytes) in library ref
 *   'D' u32 id                  dump the buffer
 * Output: "KQR1", then per call 'C' and its i64 result, per dump 'D', u64 n and n bytes.
 *
 * Calls: every argument is an integer (addresses included, passed as 64-bit: an int32
 * parameter reads the low half) or a float. The function is called through one
 * prototype of 20 integers and 8 floats, which under the AAPCS64 and System V x86-64
 * calling conventions reaches any function of up to 20 integer and 8 float
 * parameters, in order within each kind (the integers past the registers go on the
 * stack in order, the floats in vector registers).
 */
#include <dlfcn.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define MAX_LIBS 16
#define MAX_BUFS 256
#define MAX_INTS 20
#define MAX_FLOATS 8

typedef int64_t (*any_fn)(int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t,
                          int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t,
                          int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, float, float,
                          float, float, float, float, float, float);

static void *libs[MAX_LIBS];
static int nlibs;
static unsigned char *bufs[MAX_BUFS];
static uint64_t sizes[MAX_BUFS];
static FILE *in, *out;

static void die(const char *what)
{
    fprintf(stderr, "harness: %s\n", what);
    exit(2);
}

static void get(void *p, size_t n)
{
    if (fread(p, 1, n, in) != n) die("script ends early");
}

static uint32_t u32(void) { uint32_t v; get(&v, 4); return v; }
static uint64_t u64(void) { uint64_t v; get(&v, 8); return v; }
static uint8_t u8(void) { uint8_t v; get(&v, 1); return v; }

static char *text(void)
{
    uint32_t n = u32();
    char *s = malloc((size_t)n + 1);
    if (!s) die("out of memory");
    get(s, n);
    s[n] = 0;
    return s;
}

static uint32_t buffer_id(void)
{
    uint32_t id = u32();
    if (id >= MAX_BUFS || !bufs[id]) die("no such buffer");
    return id;
}

static void *symbol(uint32_t lib, const char *name)
{
    if (lib >= (uint32_t)nlibs) die("no such library");
    void *f = dlsym(libs[lib], name);
    if (!f) {
        fprintf(stderr, "harness: no symbol %s\n", name);
        exit(2);
    }
    return f;
}

static void load(void)
{
    char *path = text();
    if (nlibs == MAX_LIBS) die("too many libraries");
    libs[nlibs] = dlopen(path, RTLD_NOW | RTLD_LOCAL);
    if (!libs[nlibs]) {
        fprintf(stderr, "harness: %s\n", dlerror());
        exit(2);
    }
    nlibs++;
    free(path);
}

static void allocate(void)
{
    uint32_t id = u32();
    uint64_t n = u64();
    uint8_t full = u8();
    if (id >= MAX_BUFS || bufs[id]) die("bad buffer id");
    /* 64-byte aligned, with a vector's slack past the end, as NumPy's allocations. */
    bufs[id] = aligned_alloc(64, (size_t)((n + 64 + 63) / 64 * 64));
    if (!bufs[id]) die("out of memory");
    memset(bufs[id], 0, (size_t)n + 64);
    sizes[id] = n;
    if (full) get(bufs[id], (size_t)n);
}

static void point(void)
{
    uint32_t id = buffer_id();
    uint64_t at = u64();
    uint32_t to = buffer_id();
    uint64_t off = u64();
    if (at + 8 > sizes[id] || off > sizes[to]) die("address field out of range");
    int64_t address = (int64_t)(intptr_t)(bufs[to] + off);
    memcpy(bufs[id] + at, &address, 8);
}

static void call(void)
{
    uint32_t lib = u32();
    char *name = text();
    any_fn f = (any_fn)symbol(lib, name);
    int64_t a[MAX_INTS] = {0};
    float x[MAX_FLOATS] = {0};
    uint8_t ni = u8();
    if (ni > MAX_INTS) die("too many integer arguments");
    for (int i = 0; i < ni; i++) {
        uint8_t kind = u8();
        int64_t v = (int64_t)u64();
        uint32_t ref = u32();
        if (kind == 0) {
            a[i] = v;
        } else if (kind == 1) {
            if (ref >= MAX_BUFS || !bufs[ref]) die("no such buffer");
            a[i] = (int64_t)(intptr_t)(bufs[ref] + v);
        } else {
            char *other = text();
            a[i] = (int64_t)(intptr_t)symbol(ref, other);
            free(other);
        }
    }
    uint8_t nf = u8();
    if (nf > MAX_FLOATS) die("too many float arguments");
    get(x, (size_t)nf * 4);
    int64_t r = f(a[0], a[1], a[2], a[3], a[4], a[5], a[6], a[7], a[8], a[9], a[10], a[11],
                  a[12], a[13], a[14], a[15], a[16], a[17], a[18], a[19], x[0], x[1], x[2],
                  x[3], x[4], x[5], x[6], x[7]);
    fputc('C', out);
    fwrite(&r, 8, 1, out);
    free(name);
}

static void dump(void)
{
    uint32_t id = buffer_id();
    fputc('D', out);
    fwrite(&sizes[id], 8, 1, out);
    fwrite(bufs[id], 1, (size_t)sizes[id], out);
}

int main(int argc, char **argv)
{
    if (argc != 3) die("usage: harness SCRIPT OUTPUT");
    in = fopen(argv[1], "rb");
    out = fopen(argv[2], "wb");
    if (!in || !out) die("cannot open the script or the output");
    char magic[4];
    get(magic, 4);
    if (memcmp(magic, "KQS1", 4) != 0) die("not a script");
    fwrite("KQR1", 1, 4, out);
    int op;
    while ((op = fgetc(in)) != EOF) {
        switch (op) {
        case 'L': load(); break;
        case 'B': allocate(); break;
        case 'P': point(); break;
        case 'C': call(); break;
        case 'D': dump(); break;
        default: die("unknown record");
        }
    }
    return fclose(out) == 0 ? 0 : 2;
}
