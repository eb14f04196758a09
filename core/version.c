/* version.c — duet_version(): the library's version and its backends. */
#include "duet.h"

#define DUET__STR(x) #x
#define DUET__XSTR(x) DUET__STR(x)

/* The build defines DUET_BACKEND_<NAME>=1 for each GPU backend it compiles
 * (backends/<name>/<name>.cmake); cpu is always there. */
static const char backends_compiled[] = "cpu"
#if DUET_BACKEND_VULKAN
                                        " vulkan"
#endif
#if DUET_BACKEND_OPENCL
                                        " opencl"
#endif
    ;

static const char version[] =
    DUET__XSTR(DUET_VERSION_MAJOR) "." DUET__XSTR(DUET_VERSION_MINOR) "." DUET__XSTR(DUET_VERSION_PATCH);

const char *duet_version(const char **backends) {
    if (backends) *backends = backends_compiled;
    return version;
}
