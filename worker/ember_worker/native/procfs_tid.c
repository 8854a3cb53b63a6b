/*
 * procfs_tid: lets a replica in its own PID namespace open /proc paths that name its
 * own threads by the ids it sees.
 *
 * A replica runs in a new PID namespace but shares the node's /proc (a mount namespace
 * with a /proc of its own would have to be dumped and rebuilt by CRIU at every restore).
 * That /proc lists threads by their ids in the node's namespace, while gettid() gives
 * the replica its ids in its own: /proc/self/task/2/comm does not exist for the thread
 * the replica knows as 2. NVIDIA's CUDA driver opens exactly that path while cuInit()
 * names its helper thread, and fails with CUDA_ERROR_OPERATING_SYSTEM (304).
 *
 * Loaded with LD_PRELOAD, this library rewrites such paths before the C library opens
 * them: /proc/<own pid>/... becomes /proc/self/..., and /proc/self/task/<tid>/... names
 * the thread by its id in the node's namespace (read from the NSpid: lines of
 * /proc/self/task/.../status). Paths that exist as given are left alone, so outside a
 * PID namespace it changes nothing.
 */
#define _GNU_SOURCE
#include <dirent.h>
#include <dlfcn.h>
#include <fcntl.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/syscall.h>
#include <unistd.h>

#define SELF_TASK "/proc/self/task/"

/* The id in the node's namespace of our thread whose innermost id is `tid`; 0 if none. */
static long outer_tid(long tid) {
    DIR *tasks = opendir(SELF_TASK);
    if (!tasks) return 0;
    long found = 0;
    struct dirent *entry;
    while (!found && (entry = readdir(tasks))) {
        if (entry->d_name[0] < '0' || entry->d_name[0] > '9') continue;
        char status_path[sizeof SELF_TASK + sizeof entry->d_name + 8];
        snprintf(status_path, sizeof status_path, SELF_TASK "%s/status", entry->d_name);
        int fd = (int)syscall(SYS_openat, AT_FDCWD, status_path, O_RDONLY | O_CLOEXEC);
        if (fd < 0) continue;
        char text[4096];
        ssize_t length = read(fd, text, sizeof text - 1);
        close(fd);
        if (length <= 0) continue;
        text[length] = '\0';
        char *line = strstr(text, "\nNSpid:");
        if (!line) continue;
        char *end = strchr(line + 1, '\n');
        if (end) *end = '\0';
        char *innermost = strrchr(line, '\t');
        if (innermost && strtol(innermost + 1, NULL, 10) == tid)
            found = strtol(entry->d_name, NULL, 10);
    }
    closedir(tasks);
    return found;
}

/* Whether `text` fitted in `size` bytes (snprintf's answer); a cut path would be wrong. */
static int fitted(int written, size_t size) { return written >= 0 && (size_t)written < size; }

/* `path`, or a rewritten copy of it in `buffer` that names our own threads correctly. */
static const char *translated(const char *path, char *buffer, size_t size) {
    if (!path || strncmp(path, "/proc/", 6) != 0) return path;
    const char *rest = path + 6;
    char *end;
    long pid = strtol(rest, &end, 10);
    if (end != rest && (*end == '/' || *end == '\0') && pid == getpid()) {
        /* /proc/<our pid as we see it>: ourselves, whatever /proc says that pid is */
        if (!fitted(snprintf(buffer, size, "/proc/self%s", end), size)) return path;
        path = buffer;
    }
    if (strncmp(path, SELF_TASK, strlen(SELF_TASK)) != 0) return path;
    rest = path + strlen(SELF_TASK);
    long tid = strtol(rest, &end, 10);
    if (end == rest || (*end != '/' && *end != '\0')) return path;
    char task_dir[64];
    snprintf(task_dir, sizeof task_dir, SELF_TASK "%ld", tid);
    if (syscall(SYS_faccessat, AT_FDCWD, task_dir, F_OK) == 0) return path; /* as given */
    char tail[4096];
    if (!fitted(snprintf(tail, sizeof tail, "%s", end), sizeof tail)) return path;
    if (tid == (long)syscall(SYS_gettid))
        return fitted(snprintf(buffer, size, "/proc/thread-self%s", tail), size) ? buffer : path;
    long outer = outer_tid(tid);
    if (outer == 0) return path;
    return fitted(snprintf(buffer, size, SELF_TASK "%ld%s", outer, tail), size) ? buffer : path;
}

static int wants_mode(int flags) { return (flags & O_CREAT) || (flags & O_TMPFILE) == O_TMPFILE; }

#define NEXT(name) static __typeof__(name) *next_##name; \
    if (!next_##name) next_##name = (__typeof__(name) *)dlsym(RTLD_NEXT, #name)

int open(const char *path, int flags, ...) {
    NEXT(open);
    mode_t mode = 0;
    if (wants_mode(flags)) { va_list args; va_start(args, flags); mode = va_arg(args, mode_t); va_end(args); }
    char buffer[4096];
    return next_open(translated(path, buffer, sizeof buffer), flags, mode);
}

int open64(const char *path, int flags, ...) {
    NEXT(open64);
    mode_t mode = 0;
    if (wants_mode(flags)) { va_list args; va_start(args, flags); mode = va_arg(args, mode_t); va_end(args); }
    char buffer[4096];
    return next_open64(translated(path, buffer, sizeof buffer), flags, mode);
}

int openat(int dirfd, const char *path, int flags, ...) {
    NEXT(openat);
    mode_t mode = 0;
    if (wants_mode(flags)) { va_list args; va_start(args, flags); mode = va_arg(args, mode_t); va_end(args); }
    char buffer[4096];
    return next_openat(dirfd, translated(path, buffer, sizeof buffer), flags, mode);
}

int openat64(int dirfd, const char *path, int flags, ...) {
    NEXT(openat64);
    mode_t mode = 0;
    if (wants_mode(flags)) { va_list args; va_start(args, flags); mode = va_arg(args, mode_t); va_end(args); }
    char buffer[4096];
    return next_openat64(dirfd, translated(path, buffer, sizeof buffer), flags, mode);
}

FILE *fopen(const char *path, const char *how) {
    NEXT(fopen);
    char buffer[4096];
    return next_fopen(translated(path, buffer, sizeof buffer), how);
}

FILE *fopen64(const char *path, const char *how) {
    NEXT(fopen64);
    char buffer[4096];
    return next_fopen64(translated(path, buffer, sizeof buffer), how);
}
