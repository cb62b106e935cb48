/* Stand-in for the AAR's Android libonnxruntime.so: forwards the three functions the JNI
 * library imports (version node VERS_1.29.0) to the Linux libonnxruntime.so.1.x that the
 * PyPI onnxruntime wheel ships, loaded by path from ORT_LINUX_LIB at first use. */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <stdio.h>
#include <stdlib.h>

static void *real_lib(void) {
    static void *lib;
    if (!lib) {
        const char *path = getenv("ORT_LINUX_LIB");
        lib = path ? dlopen(path, RTLD_NOW | RTLD_LOCAL) : NULL;
        if (!lib) { fprintf(stderr, "ort shim: cannot load ORT_LINUX_LIB=%s: %s\n", path ? path : "(unset)", dlerror()); abort(); }
    }
    return lib;
}
static void *find(const char *name) {
    void *f = dlsym(real_lib(), name);
    if (!f) { fprintf(stderr, "ort shim: %s missing in %s\n", name, getenv("ORT_LINUX_LIB")); abort(); }
    return f;
}
typedef const void *(*base_fn)(void);
typedef void *(*append_fn)(void *, unsigned);
const void *shim_OrtGetApiBase(void) { return ((base_fn)find("OrtGetApiBase"))(); }
void *shim_append_cpu(void *opts, unsigned flags) { return ((append_fn)find("OrtSessionOptionsAppendExecutionProvider_CPU"))(opts, flags); }
void *shim_append_nnapi(void *opts, unsigned flags) {
    (void)opts; (void)flags;
    fprintf(stderr, "ort shim: NNAPI exists only on Android\n");
    abort();
}
__asm__(".symver shim_OrtGetApiBase,OrtGetApiBase@@VERS_1.29.0");
__asm__(".symver shim_append_cpu,OrtSessionOptionsAppendExecutionProvider_CPU@@VERS_1.29.0");
__asm__(".symver shim_append_nnapi,OrtSessionOptionsAppendExecutionProvider_Nnapi@@VERS_1.29.0");
