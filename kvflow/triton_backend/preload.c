/* The LD_PRELOAD library `kvflow serve` starts tritonserver with (kvflow/triton_backend/preload.py
 * builds it with the machine's C compiler). It does three things tritonserver has no option for.
 *
 * 1. Secrets off the command line. tritonserver takes its restricted-API keys only as arguments,
 *    and every local user can read /proc/<pid>/cmdline. `kvflow serve` puts the placeholder
 *    argument "@kvflow-secret" where a secret argument belongs, writes the real arguments (one a
 *    line) into a pipe, and names the pipe's read end in KVFLOW_SECRET_ARGS_FD. Before main()
 *    runs, the constructor below reads them and points each placeholder's argv[] slot, in order,
 *    at a heap copy. /proc/<pid>/cmdline reads the original argument memory, so it keeps showing
 *    the placeholders, and the secrets were never in the environment either.
 *    Fail closed: if the arguments do not add up it exits before main(); if this library is not
 *    loaded at all, tritonserver refuses the placeholder as an unexpected argument.
 *
 * 2. Private shared memory. The Python backend's IPC regions in /dev/shm carry request text.
 *    Boost.Interprocess creates them with shm_open and then fchmods them to 0644, which undoes
 *    the umask `kvflow serve` sets (0077). The fchmod below applies the umask to shared-memory
 *    objects, so that they stay 0600 from the moment they exist.
 *
 * 3. INT32 clients of INT64 inputs. kvflow declares its integer inputs INT64, because Triton's
 *    HTTP JSON parser wraps a value that does not fit a 32-bit input (2**32 + 5 becomes 5)
 *    before the backend could refuse it. Clients written for TensorRT-LLM send the same inputs
 *    as INT32, and Triton converts no types (an input has one type). The functions at the end
 *    sit between tritonserver's frontends and libtritonserver: an INT32 input named in
 *    KVFLOW_WIDEN_INPUTS is declared to the core as INT64, its data copied, sign-extended, into
 *    a buffer freed with the request. Every value fits, so nothing wraps and kvflow checks it.
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <errno.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#define PLACEHOLDER "@kvflow-secret"
#define FD_VARIABLE "KVFLOW_SECRET_ARGS_FD"
#define MAX_BYTES 65536

static mode_t process_umask;

static void die(const char *why) {
    fprintf(stderr, "kvflow preload: %s\n", why);
    _exit(70);
}

/* Everything the descriptor holds, NUL-terminated. */
static char *read_all(int fd) {
    char *buf = malloc(MAX_BYTES + 1);
    size_t len = 0;
    if (buf == NULL)
        die("out of memory");
    for (;;) {
        ssize_t n = read(fd, buf + len, MAX_BYTES - len);
        if (n == 0)
            break;
        if (n < 0 && errno == EINTR)
            continue;
        if (n < 0 || len + (size_t)n >= MAX_BYTES)
            die("cannot read the secret arguments");
        len += (size_t)n;
    }
    close(fd);
    buf[len] = '\0';
    return buf;
}

static void replace_placeholders(int argc, char **argv, char *secrets) {
    char *next = secrets;
    for (int i = 1; i < argc; i++) {
        if (strcmp(argv[i], PLACEHOLDER) != 0)
            continue;
        if (*next == '\0')
            die("more placeholders than secret arguments");
        char *line_end = strchr(next, '\n');
        if (line_end != NULL)
            *line_end = '\0';
        argv[i] = next;  /* NOTE: the buffer is never freed: argv lives as long as the process */
        next = line_end != NULL ? line_end + 1 : next + strlen(next);
    }
    if (*next != '\0')
        die("more secret arguments than placeholders");
}

/* glibc calls a preloaded library's constructors with main()'s argc, argv and envp. */
__attribute__((constructor)) static void kvflow_preload(int argc, char **argv, char **envp) {
    (void)envp;
    process_umask = umask(0);  /* the umask can only be read by setting it: set it back */
    umask(process_umask);
    const char *fd_text = getenv(FD_VARIABLE);
    if (fd_text == NULL)
        return;  /* a backend stub: it inherits LD_PRELOAD (for fchmod), not the secrets */
    char *end = NULL;
    long fd = strtol(fd_text, &end, 10);
    if (end == fd_text || *end != '\0' || fd < 0)
        die(FD_VARIABLE " is not a file descriptor");
    replace_placeholders(argc, argv, read_all((int)fd));
    unsetenv(FD_VARIABLE);
}

static int is_shared_memory(int fd) {
    char link[64], target[32];
    snprintf(link, sizeof link, "/proc/self/fd/%d", fd);
    ssize_t n = readlink(link, target, sizeof target - 1);
    return n >= 9 && strncmp(target, "/dev/shm/", 9) == 0;
}

int fchmod(int fd, mode_t mode) {
    static int (*real_fchmod)(int, mode_t);
    if (real_fchmod == NULL)
        real_fchmod = (int (*)(int, mode_t))dlsym(RTLD_NEXT, "fchmod");
    if (is_shared_memory(fd))
        mode &= ~process_umask;
    return real_fchmod(fd, mode);
}

/* 3. INT32 clients of INT64 inputs (see the top of the file). The prototypes are Triton's C API
 *    (tritonserver.h) with its handles as void *: errors are returned as they come. */
#define WIDEN_VARIABLE "KVFLOW_WIDEN_INPUTS"
#define TYPE_INT32 8 /* TRITONSERVER_DataType */
#define TYPE_INT64 9
#define MEMORY_CPU 0 /* TRITONSERVER_MemoryType */
#define MEMORY_CPU_PINNED 1

typedef void *(*add_input_fn)(void *, const char *, int, const int64_t *, uint64_t);
typedef void *(*append_fn)(void *, const char *, const void *, size_t, int, int64_t);
typedef void *(*append_attributes_fn)(void *, const char *, const void *, void *);
typedef void *(*attribute_size_fn)(void *, size_t *);
typedef void *(*attribute_int_fn)(void *, void *);
typedef void *(*delete_fn)(void *);

/* One widened input of a live request; its buffer is NULL until its data arrives. */
struct widened {
    void *request;
    char *name;
    int64_t *buffer;
    struct widened *next;
};
static struct widened *widened_inputs;
static pthread_mutex_t widened_lock = PTHREAD_MUTEX_INITIALIZER;

static void *next_symbol(const char *symbol) {
    void *fn = dlsym(RTLD_NEXT, symbol);
    if (fn == NULL)
        die("a libtritonserver function is missing");
    return fn;
}

static int is_widened(const char *name) {
    const char *list = getenv(WIDEN_VARIABLE);
    size_t len = strlen(name);
    while (list != NULL && *list != '\0') {
        const char *end = strchr(list, ',');
        size_t item = end != NULL ? (size_t)(end - list) : strlen(list);
        if (item == len && strncmp(list, name, len) == 0)
            return 1;
        list = end != NULL ? end + 1 : NULL;
    }
    return 0;
}

void *TRITONSERVER_InferenceRequestAddInput(void *request, const char *name, int datatype,
                                            const int64_t *shape, uint64_t dim_count) {
    static add_input_fn real_add;
    if (real_add == NULL)
        real_add = (add_input_fn)next_symbol("TRITONSERVER_InferenceRequestAddInput");
    if (datatype != TYPE_INT32 || !is_widened(name))
        return real_add(request, name, datatype, shape, dim_count);
    void *error = real_add(request, name, TYPE_INT64, shape, dim_count);
    if (error != NULL)
        return error;
    struct widened *w = calloc(1, sizeof *w);
    if (w == NULL || (w->name = strdup(name)) == NULL)
        die("out of memory");
    w->request = request;
    pthread_mutex_lock(&widened_lock);
    w->next = widened_inputs;
    widened_inputs = w;
    pthread_mutex_unlock(&widened_lock);
    return NULL;
}

/* A widened input's data as int64 (freed with the request), or NULL: not widened, or not whole
 * int32 values in CPU memory in one piece (the core then refuses its byte size). */
static int64_t *widen_data(void *request, const char *name, const void *base, size_t size,
                           int memory) {
    if (size % sizeof(int32_t) != 0 || (memory != MEMORY_CPU && memory != MEMORY_CPU_PINNED))
        return NULL;
    int64_t *out = NULL;
    pthread_mutex_lock(&widened_lock);
    for (struct widened *w = widened_inputs; w != NULL; w = w->next) {
        if (w->request != request || w->buffer != NULL || strcmp(w->name, name) != 0)
            continue;
        out = malloc(size * 2 + 1);
        if (out == NULL)
            die("out of memory");
        const int32_t *in = base;
        for (size_t i = 0; i < size / sizeof(int32_t); i++)
            out[i] = in[i];
        w->buffer = out;
        break;
    }
    pthread_mutex_unlock(&widened_lock);
    return out;
}

static append_fn real_append(void) {
    static append_fn fn;
    if (fn == NULL)
        fn = (append_fn)next_symbol("TRITONSERVER_InferenceRequestAppendInputData");
    return fn;
}

void *TRITONSERVER_InferenceRequestAppendInputData(void *request, const char *name,
                                                   const void *base, size_t size, int memory,
                                                   int64_t memory_id) {
    int64_t *wide = widen_data(request, name, base, size, memory);
    if (wide != NULL)
        return real_append()(request, name, wide, size * 2, memory, memory_id);
    return real_append()(request, name, base, size, memory, memory_id);
}

void *TRITONSERVER_InferenceRequestAppendInputDataWithBufferAttributes(
        void *request, const char *name, const void *base, void *attributes) {
    static append_attributes_fn real_append_attributes;
    static attribute_size_fn size_of;
    static attribute_int_fn memory_of, memory_id_of;
    if (real_append_attributes == NULL) {
        size_of = (attribute_size_fn)next_symbol("TRITONSERVER_BufferAttributesByteSize");
        memory_of = (attribute_int_fn)next_symbol("TRITONSERVER_BufferAttributesMemoryType");
        memory_id_of = (attribute_int_fn)next_symbol("TRITONSERVER_BufferAttributesMemoryTypeId");
        real_append_attributes = (append_attributes_fn)next_symbol(
            "TRITONSERVER_InferenceRequestAppendInputDataWithBufferAttributes");
    }
    size_t size = 0;
    int memory = -1;
    int64_t memory_id = 0;
    if (size_of(attributes, &size) == NULL && memory_of(attributes, &memory) == NULL &&
        memory_id_of(attributes, &memory_id) == NULL) {
        int64_t *wide = widen_data(request, name, base, size, memory);
        if (wide != NULL)
            return real_append()(request, name, wide, size * 2, memory, memory_id);
    }
    return real_append_attributes(request, name, base, attributes);
}

void *TRITONSERVER_InferenceRequestDelete(void *request) {
    static delete_fn real_delete;
    if (real_delete == NULL)
        real_delete = (delete_fn)next_symbol("TRITONSERVER_InferenceRequestDelete");
    /* NOTE: unlinked before the request is deleted, freed after: once deleted, its address may
     * belong to a new request at once. */
    struct widened *mine = NULL;
    pthread_mutex_lock(&widened_lock);
    for (struct widened **p = &widened_inputs; *p != NULL;) {
        struct widened *w = *p;
        if (w->request != request) {
            p = &w->next;
            continue;
        }
        *p = w->next;
        w->next = mine;
        mine = w;
    }
    pthread_mutex_unlock(&widened_lock);
    void *error = real_delete(request);
    while (mine != NULL) {
        struct widened *w = mine;
        mine = w->next;
        free(w->buffer);
        free(w->name);
        free(w);
    }
    return error;
}
