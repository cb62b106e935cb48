/* Stand-in for bionic's libdl.so: dlclose under version node LIBC, forwarded to glibc. */
#define _GNU_SOURCE
#include <dlfcn.h>
typedef int (*close_fn)(void *);
int shim_dlclose(void *h) {
    close_fn real = (close_fn)dlvsym(RTLD_DEFAULT, "dlclose", "GLIBC_2.34");
    if (!real) real = (close_fn)dlvsym(RTLD_DEFAULT, "dlclose", "GLIBC_2.2.5");
    return real(h);
}
__asm__(".symver shim_dlclose,dlclose@@LIBC");
