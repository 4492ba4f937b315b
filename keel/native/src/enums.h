/* How a kernel library reports the enum values the Python side builds its arrays in.
 *
 * KEEL_ENUM_EXPORT(function, LIST), LIST an X-macro list of enum constants, defines
 * function(out, n), which writes at most n of their values and returns their count, and
 * function_names(), their names, each followed by a space. The Python side checks them
 * by name at load (keel.backends.cpu.native_gemm.check_enums), so an order changed on
 * one side alone fails the load instead of reading the wrong slots.
 */
#ifndef KEEL_ENUMS_H
#define KEEL_ENUMS_H

#include <stdint.h>

#define KEEL_ENUM_VALUE(e) e,
#define KEEL_ENUM_NAME(e) #e " "
#define KEEL_ENUM_EXPORT(function, LIST)                                         \
    int64_t function(int64_t *out, int64_t n)                                    \
    {                                                                            \
        const int64_t values[] = {LIST(KEEL_ENUM_VALUE)};                        \
        const int64_t count = (int64_t)(sizeof values / sizeof values[0]);       \
        for (int64_t i = 0; i < n && i < count; i++) out[i] = values[i];         \
        return count;                                                            \
    }                                                                            \
    const char *function##_names(void) { return LIST(KEEL_ENUM_NAME); }

#endif
