/* Stand-in for Android's bionic libc.so, so that the AAR's x86_64 libonnxruntime4j_jni.so
 * (linked against bionic) loads into a glibc JVM for desktop tests. Exports exactly the
 * names the JNI library imports, under bionic's version node LIBC, each forwarding to glibc
 * through a name that cannot bind back to this library (see the notes: a plain `malloc`
 * here would resolve to itself). Test-only: never shipped in an app. */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <stddef.h>
#include <string.h>

extern void *__libc_malloc(size_t);
extern void __libc_free(void *);
extern void *__libc_realloc(void *, size_t);

void *shim_malloc(size_t n) { return __libc_malloc(n); }
void shim_free(void *p) { __libc_free(p); }
void *shim_realloc(void *p, size_t n) { return __libc_realloc(p, n); }

void *shim_memcpy(void *d, const void *s, size_t n) {
    unsigned char *dd = d; const unsigned char *ss = s;
    while (n--) *dd++ = *ss++;
    return d;
}
size_t shim_strlen(const char *s) { const char *p = s; while (*p) ++p; return (size_t)(p - s); }

typedef int (*atexit_fn)(void (*)(void *), void *, void *);
typedef void (*finalize_fn)(void *);
typedef int (*atfork_fn)(void (*)(void), void (*)(void), void (*)(void), void *);
typedef void (*chk_fn)(void);

int shim_cxa_atexit(void (*f)(void *), void *arg, void *dso) {
    atexit_fn real = (atexit_fn)dlvsym(RTLD_DEFAULT, "__cxa_atexit", "GLIBC_2.2.5");
    return real(f, arg, dso);
}
void shim_cxa_finalize(void *dso) {
    finalize_fn real = (finalize_fn)dlvsym(RTLD_DEFAULT, "__cxa_finalize", "GLIBC_2.2.5");
    real(dso);
}
int shim_register_atfork(void (*a)(void), void (*b)(void), void (*c)(void), void *dso) {
    atfork_fn real = (atfork_fn)dlvsym(RTLD_DEFAULT, "__register_atfork", "GLIBC_2.3.2");
    return real(a, b, c, dso);
}
void shim_stack_chk_fail(void) {
    chk_fn real = (chk_fn)dlvsym(RTLD_DEFAULT, "__stack_chk_fail", "GLIBC_2.4");
    real();
    __builtin_trap();
}

__asm__(".symver shim_malloc,malloc@@LIBC");
__asm__(".symver shim_free,free@@LIBC");
__asm__(".symver shim_realloc,realloc@@LIBC");
__asm__(".symver shim_memcpy,memcpy@@LIBC");
__asm__(".symver shim_strlen,strlen@@LIBC");
__asm__(".symver shim_cxa_atexit,__cxa_atexit@@LIBC");
__asm__(".symver shim_cxa_finalize,__cxa_finalize@@LIBC");
__asm__(".symver shim_register_atfork,__register_atfork@@LIBC");
__asm__(".symver shim_stack_chk_fail,__stack_chk_fail@@LIBC");
