/*
 * slowfs: a read-only passthrough FUSE filesystem that behaves like slow storage.
 * Built and started by tools/slowfs.py, which documents the options; see there.
 *
 * Written in C so that emulating the store costs almost no CPU: on a 2-core machine a
 * Python emulator spent as much CPU as the cache it was measuring.
 *
 *   network model: every request waits `latency` (many in flight at once); data moves
 *                  through one link of `bandwidth` bytes/s shared by all requests.
 *   disk model (seek > 0): one head. Transfers happen one at a time, nearest waiting
 *                  request first (within a deadline), and one that does not continue
 *                  within 1 MiB of the last pays `seek` first. Files lie on the disk back
 *                  to back in sorted path order.
 *
 * Counters: getfattr -n user.slowfs.stats MOUNTPOINT (JSON); user.slowfs.reset zeroes them.
 */
#define FUSE_USE_VERSION 312
#define _GNU_SOURCE
#include <fuse.h>
#include <fuse_lowlevel.h>

#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/statvfs.h>
#include <sys/uio.h>
#include <time.h>
#include <unistd.h>

static struct {
    char root[PATH_MAX];
    double latency, bandwidth, seek, attr_timeout;
} opt;

static atomic_long n_getattr, n_readdir, n_open, n_read, n_readlink, n_bytes, n_seeks;
static atomic_long in_flight, peak_in_flight;  /* requests waiting out their latency at once */

static pthread_mutex_t link_lock = PTHREAD_MUTEX_INITIALIZER;
static pthread_mutex_t head_lock = PTHREAD_MUTEX_INITIALIZER;
static double link_free_at;
static long long head_pos;

struct placed { char *path; long long offset; };
static struct placed *layout;
static size_t layout_n, layout_cap;
static long long layout_end;

static double now(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec + ts.tv_nsec / 1e9;
}

static void sleep_for(double s) {
    if (s <= 0) return;
    struct timespec ts = {(time_t)s, (long)((s - (time_t)s) * 1e9)};
    while (nanosleep(&ts, &ts) == -1 && errno == EINTR) {}
}

static void full_path(char *out, const char *path) {
    snprintf(out, PATH_MAX, "%s%s", opt.root, path);
}

/* --- disk layout: files in sorted path order, back to back --- */

static void place(const char *rel, long long size) {
    if (layout_n == layout_cap) {
        layout_cap = layout_cap ? layout_cap * 2 : 1024;
        layout = realloc(layout, layout_cap * sizeof *layout);
    }
    layout[layout_n].path = strdup(rel);
    layout[layout_n].offset = layout_end;
    layout_n++;
    layout_end += size;
}

static void lay_out(const char *rel) {
    char full[PATH_MAX];
    full_path(full, rel);
    struct dirent **names;
    int n = scandir(full, &names, NULL, alphasort);
    if (n < 0) return;
    for (int i = 0; i < n; i++) {
        const char *name = names[i]->d_name;
        if (strcmp(name, ".") && strcmp(name, "..")) {
            char child[PATH_MAX], childfull[PATH_MAX];
            snprintf(child, sizeof child, "%s/%s", strcmp(rel, "/") ? rel : "", name);
            full_path(childfull, child);
            struct stat st;
            if (lstat(childfull, &st) == 0) {
                if (S_ISDIR(st.st_mode)) lay_out(child);
                else if (S_ISREG(st.st_mode)) place(child, st.st_size);
            }
        }
        free(names[i]);
    }
    free(names);
}

static int cmp_placed(const void *a, const void *b) {
    return strcmp(((const struct placed *)a)->path, ((const struct placed *)b)->path);
}

static long long position_of(const char *path, long long size_hint) {
    struct placed key = {(char *)path, 0};
    pthread_mutex_lock(&head_lock);  /* callers hold no other lock */
    struct placed *hit = bsearch(&key, layout, layout_n, sizeof *layout, cmp_placed);
    long long pos = hit ? hit->offset : layout_end;
    if (!hit) layout_end += size_hint;  /* created after mount: appended at the end */
    pthread_mutex_unlock(&head_lock);
    return pos;
}

/* --- the link --- */

/* The disk's queue: like a drive with command queueing under Linux's mq-deadline, the
 * head serves the waiting request nearest to it, unless one has waited longer than
 * DEADLINE, which then goes first. Without any reordering, a single sequential reader
 * sharing the disk with random readers would pay two seeks for every random read. */
#define DEADLINE 0.5  /* mq-deadline's default read_expire: 500 ms */
struct waiter { long long pos; double since; pthread_cond_t cond; struct waiter *next; };
static struct waiter *waiting;
static int head_busy;

static struct waiter *pick(void) {  /* head_lock held */
    struct waiter *best = NULL, *oldest = NULL;
    double t = now();
    for (struct waiter *w = waiting; w; w = w->next) {
        if (!oldest || w->since < oldest->since) oldest = w;
        long long d = w->pos - head_pos, bd = best ? best->pos - head_pos : 0;
        if (d < 0) d = -d;
        if (bd < 0) bd = -bd;
        if (!best || d < bd) best = w;
    }
    if (oldest && t - oldest->since > DEADLINE) return oldest;
    return best;
}

static void disk_transfer(long long pos, long long nbytes) {
    struct waiter me = {pos, now(), PTHREAD_COND_INITIALIZER, NULL};
    pthread_mutex_lock(&head_lock);
    me.next = waiting;
    waiting = &me;
    while (head_busy || pick() != &me) {
        if (!head_busy) pthread_cond_signal(&pick()->cond);
        pthread_cond_wait(&me.cond, &head_lock);
    }
    for (struct waiter **w = &waiting; *w; w = &(*w)->next)
        if (*w == &me) { *w = me.next; break; }
    head_busy = 1;
    long long gap = pos - head_pos;
    pthread_mutex_unlock(&head_lock);
    if (gap < 0) gap = -gap;
    if (gap > (1 << 20)) { n_seeks++; sleep_for(opt.seek); }
    if (opt.bandwidth > 0 && nbytes) sleep_for(nbytes / opt.bandwidth);
    pthread_mutex_lock(&head_lock);
    head_pos = pos + nbytes;
    head_busy = 0;
    if (waiting) pthread_cond_signal(&pick()->cond);
    pthread_mutex_unlock(&head_lock);
    pthread_cond_destroy(&me.cond);
}

static void request(long long nbytes, const char *path, long long offset) {
    long n = ++in_flight, peak = peak_in_flight;
    while (n > peak && !atomic_compare_exchange_weak(&peak_in_flight, &peak, n)) {}
    sleep_for(opt.latency);
    in_flight--;
    if (opt.seek > 0 && path) {
        disk_transfer(position_of(path, nbytes) + offset, nbytes);
        return;
    }
    if (opt.bandwidth > 0 && nbytes) {
        pthread_mutex_lock(&link_lock);
        double t = now();
        double start = link_free_at > t ? link_free_at : t;
        link_free_at = start + nbytes / opt.bandwidth;
        double done = link_free_at;
        pthread_mutex_unlock(&link_lock);
        sleep_for(done - now());
    }
}

/* --- operations --- */

static void *sfs_init(struct fuse_conn_info *conn, struct fuse_config *cfg) {
    conn->max_read = 1 << 20;
    cfg->entry_timeout = opt.attr_timeout;
    cfg->attr_timeout = opt.attr_timeout;
    cfg->negative_timeout = 0;
    return NULL;
}

static int sfs_getattr(const char *path, struct stat *st, struct fuse_file_info *fi) {
    (void)fi;
    n_getattr++;
    request(0, NULL, 0);
    char full[PATH_MAX];
    full_path(full, path);
    return lstat(full, st) == -1 ? -errno : 0;
}

static int sfs_readlink(const char *path, char *buf, size_t size) {
    n_readlink++;
    request(0, NULL, 0);
    char full[PATH_MAX];
    full_path(full, path);
    ssize_t n = readlink(full, buf, size - 1);
    if (n == -1) return -errno;
    buf[n] = 0;
    return 0;
}

static int sfs_readdir(const char *path, void *buf, fuse_fill_dir_t filler, off_t off,
                       struct fuse_file_info *fi, enum fuse_readdir_flags flags) {
    (void)fi;
    n_readdir++;
    request(0, NULL, 0);
    char full[PATH_MAX];
    full_path(full, path);
    DIR *d = opendir(full);
    if (!d) return -errno;
    /* Entries carry their offsets (index + 1; a call resumes after `off`, as an NFS
       READDIRPLUS resumes at a cookie): libfuse 3.14 links READDIRPLUS entries into the
       kernel's dentry cache only in this mode. */
    struct dirent *e;
    off_t index = 0;
    while ((e = readdir(d))) {
        if (index++ < off) continue;
        /* with each entry's attributes when the kernel asks for them (READDIRPLUS), as an
           NFS server's READDIRPLUS gives them: one request lists a directory and stats it */
        struct stat st = {0};
        enum fuse_fill_dir_flags fill = 0;
        if ((flags & FUSE_READDIR_PLUS) && fstatat(dirfd(d), e->d_name, &st, AT_SYMLINK_NOFOLLOW) == 0) {
            fill = FUSE_FILL_DIR_PLUS;
        } else {
            st.st_ino = e->d_ino;
            st.st_mode = DTTOIF(e->d_type);
        }
        if (filler(buf, e->d_name, &st, index, fill)) break;
    }
    closedir(d);
    return 0;
}

static int sfs_open(const char *path, struct fuse_file_info *fi) {
    n_open++;
    request(0, NULL, 0);
    if ((fi->flags & O_ACCMODE) != O_RDONLY) return -EROFS;
    char full[PATH_MAX];
    full_path(full, path);
    int fd = open(full, O_RDONLY);
    if (fd == -1) return -errno;
    fi->fh = fd;
    return 0;  /* no keep_cache: each open rereads from the "store" */
}

static int sfs_read(const char *path, char *buf, size_t size, off_t off, struct fuse_file_info *fi) {
    ssize_t n = pread(fi->fh, buf, size, off);
    if (n == -1) return -errno;
    n_read++;
    n_bytes += n;
    request(n, path, off);
    return n;
}

static int sfs_release(const char *path, struct fuse_file_info *fi) {
    (void)path;
    close(fi->fh);
    return 0;
}

static int sfs_statfs(const char *path, struct statvfs *st) {
    (void)path;
    return statvfs(opt.root, st) == -1 ? -errno : 0;
}

static int sfs_getxattr(const char *path, const char *name, char *value, size_t size) {
    char out[512];
    int len;
    if (strcmp(path, "/") || strncmp(name, "user.slowfs.", 12)) return -ENODATA;
    if (!strcmp(name, "user.slowfs.reset")) {
        n_getattr = n_readdir = n_open = n_read = n_readlink = n_bytes = n_seeks = peak_in_flight = 0;
        len = snprintf(out, sizeof out, "{}");
    } else if (!strcmp(name, "user.slowfs.stats")) {
        len = snprintf(out, sizeof out,
                       "{\"getattr\": %ld, \"readdir\": %ld, \"open\": %ld, \"read\": %ld, "
                       "\"readlink\": %ld, \"bytes\": %ld, \"seeks\": %ld, \"peak_in_flight\": %ld}",
                       (long)n_getattr, (long)n_readdir, (long)n_open, (long)n_read,
                       (long)n_readlink, (long)n_bytes, (long)n_seeks, (long)peak_in_flight);
    } else {
        return -ENODATA;
    }
    if (size == 0) return len;
    if ((size_t)len > size) return -ERANGE;
    memcpy(value, out, len);
    return len;
}

/* --- the device: replies pass through unchanged but for INIT's --- */

/* libfuse 3.14 (Debian 12, Ubuntu 24.04) never grants FUSE_PARALLEL_DIROPS, so the kernel
 * sends one lookup at a time per directory: eight readers of one directory of a 2 ms store
 * would wait in line, which no NFS server makes them do. The INIT reply is the first reply
 * written; it gets the flag here. */
static atomic_int init_replied;

static ssize_t io_writev(int fd, struct iovec *iov, int count, void *userdata) {
    (void)userdata;
    if (!atomic_exchange(&init_replied, 1)) {
        /* iov[0]: struct fuse_out_header (16 bytes); then struct fuse_init_out, whose
           `flags` (uint32) is at byte 12. libfuse passes the two as separate iovecs. */
        if (count >= 2 && iov[1].iov_len >= 16) {
            uint32_t flags;
            memcpy(&flags, (char *)iov[1].iov_base + 12, 4);
            flags |= 1u << 18;  /* FUSE_PARALLEL_DIROPS */
            memcpy((char *)iov[1].iov_base + 12, &flags, 4);
        }
    }
    return writev(fd, iov, count);
}

static ssize_t io_read(int fd, void *buf, size_t len, void *userdata) {
    (void)userdata;
    return read(fd, buf, len);
}

static const struct fuse_operations ops = {
    .init = sfs_init,
    .getattr = sfs_getattr,
    .readlink = sfs_readlink,
    .readdir = sfs_readdir,
    .open = sfs_open,
    .read = sfs_read,
    .release = sfs_release,
    .statfs = sfs_statfs,
    .getxattr = sfs_getxattr,
};

int main(int argc, char **argv) {
    /* slowfs ROOT MOUNTPOINT LATENCY_S BANDWIDTH_BPS SEEK_S ATTR_TIMEOUT_S (validated by slowfs.py) */
    if (argc != 7) {
        fprintf(stderr, "usage: %s ROOT MOUNTPOINT LATENCY_S BANDWIDTH_BPS SEEK_S ATTR_TIMEOUT_S\n", argv[0]);
        return 2;
    }
    if (!realpath(argv[1], opt.root)) { perror(argv[1]); return 2; }
    if (!strcmp(opt.root, "/")) opt.root[0] = 0;
    opt.latency = atof(argv[3]);
    opt.bandwidth = atof(argv[4]);
    opt.seek = atof(argv[5]);
    opt.attr_timeout = atof(argv[6]);
    if (opt.seek > 0) {
        lay_out("/");
        qsort(layout, layout_n, sizeof *layout, cmp_placed);
    }
    char options[PATH_MAX + 128];
    const char *base = strrchr(opt.root, '/');
    snprintf(options, sizeof options, "ro,fsname=slowfs:%s,subtype=slowfs,max_read=1048576",
             base && base[1] ? base + 1 : "root");
    char *fargv[] = {argv[0], "-o", options, NULL};
    struct fuse_args args = FUSE_ARGS_INIT(3, fargv);
    struct fuse *f = fuse_new(&args, &ops, sizeof ops, NULL);
    if (!f) return 1;
    if (fuse_mount(f, argv[2]) != 0) { fuse_destroy(f); return 1; }
    struct fuse_session *se = fuse_get_session(f);
    /* our own I/O on the same descriptor, only to grant parallel lookups (see init_reply) */
    static const struct fuse_custom_io io = {.writev = io_writev, .read = io_read};
    if (fuse_session_custom_io(se, &io, fuse_session_fd(se)) != 0) { fuse_unmount(f); fuse_destroy(f); return 1; }
    fuse_set_signal_handlers(se);
    /* one thread per request in flight, as many as the readers send: a store's server is
       not the bottleneck being modelled (libfuse's default keeps 10 and fuse_main ignores
       max_threads in 3.14) */
    struct fuse_loop_config *cfg = fuse_loop_cfg_create();
    fuse_loop_cfg_set_max_threads(cfg, 256);
    fuse_loop_cfg_set_idle_threads(cfg, 64);
    int rc = fuse_loop_mt(f, cfg);
    fuse_loop_cfg_destroy(cfg);
    fuse_remove_signal_handlers(se);
    fuse_unmount(f);
    fuse_destroy(f);
    return rc ? 1 : 0;
}
