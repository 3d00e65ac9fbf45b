/* The LD_PRELOAD library `kvflow serve` starts tritonserver with (kvflow/triton_backend/preload.py
 * builds it with the machine's C compiler). It does two things tritonserver cannot be told to do.
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
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <errno.h>
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
