/*
 * raw_write.c: the raw-libfabric baseline for fabric-lib's benchmarks.
 *
 * One thread per process, no library in between: fi_writedata on an FI_EP_RDM endpoint, manual
 * progress by polling the completion queue. It runs the same tests as `fabric-debug client`
 * (single-write throughput per size with `window` writes in flight; 64-byte writedata op rate;
 * zero-byte writedata round trips; with --read-sizes, single-read throughput per size: fi_read
 * of the server's buffer, `window` reads in flight) and prints one JSON line per test.
 *
 *   raw_write server --provider tcp [--domain lo] --listen 127.0.0.1:0
 *   raw_write client --provider tcp [--domain lo] --connect 127.0.0.1:PORT [--sizes 4K,1M]
 *                    [--window 16] [--reps 5] [--bytes-per-rep 512M] [--op-size 64]
 *                    [--op-window 64] [--ops 200000] [--iters 10000] [--warmup-iters 1000]
 *                    [--read-sizes 4K,1M]
 *
 * Bootstrap: the server listens on TCP, prints "READY HOST:PORT", and both sides exchange
 * (fi_getname address, rkey, remote base, length). The client then sends commands over the
 * socket: 'E' imm count (reply 'K'/'F' + the count once the server counted that many
 * immediates), 'D' (done; reply 'B'). The server polls its CQ the whole time (manual progress)
 * and answers every immediate PING with a zero-byte writedata PONG.
 *
 * Provider rules honoured: FI_MR_VIRT_ADDR vs offset addressing, FI_MR_LOCAL descriptors,
 * FI_MR_ENDPOINT binding, FI_CONTEXT/FI_CONTEXT2 per-operation contexts, FI_RX_CQ_DATA
 * (receives kept posted), FI_EAGAIN (progress, then post again).
 *
 * Build: cc -O2 -o raw_write raw_write.c -lfabric
 */
#define _GNU_SOURCE
#include <arpa/inet.h>
#include <errno.h>
#include <getopt.h>
#include <netdb.h>
#include <poll.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

#include <rdma/fabric.h>
#include <rdma/fi_cm.h>
#include <rdma/fi_domain.h>
#include <rdma/fi_endpoint.h>
#include <rdma/fi_errno.h>
#include <rdma/fi_rma.h>

enum { IMM_THROUGHPUT = 1, IMM_OP_RATE = 2, IMM_PING = 4, IMM_PONG = 5 };
#define CQ_BATCH 32
#define NRECV 64
#define MAX_SIZES 64

static void die(const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    fprintf(stderr, "raw_write: error: ");
    vfprintf(stderr, fmt, ap);
    fprintf(stderr, "\n");
    va_end(ap);
    exit(1);
}

#define CHECK(call)                                                                   \
    do {                                                                              \
        int ret_ = (int)(call);                                                       \
        if (ret_) die("%s failed: %s (%d)", #call, fi_strerror(-ret_), ret_);        \
    } while (0)

static double now_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec + ts.tv_nsec * 1e-9;
}

/* ---------- options ---------- */

struct opts {
    const char *provider, *domain, *listen, *connect;
    uint64_t sizes[MAX_SIZES], read_sizes[MAX_SIZES];
    int nsizes, nread_sizes;
    uint64_t window, reps, bytes_per_rep, op_size, op_window, ops, iters, warmup_iters, buffer_size;
    double timeout;
};

static uint64_t parse_size(const char *s) {
    char *end;
    errno = 0;
    unsigned long long v = strtoull(s, &end, 10);
    if (errno || end == s) die("bad size '%s'", s);
    int shift = 0;
    if (*end == 'K' || *end == 'k') shift = 10;
    else if (*end == 'M' || *end == 'm') shift = 20;
    else if (*end == 'G' || *end == 'g') shift = 30;
    else if (*end && strcmp(end, "B") != 0) die("bad size suffix in '%s'", s);
    if (shift && end[1] && strcasecmp(end + 1, "iB") != 0 && strcasecmp(end + 1, "B") != 0)
        die("bad size suffix in '%s'", s);
    if (v == 0 || v > (UINT64_MAX >> shift)) die("size '%s' out of range", s);
    return (uint64_t)v << shift;
}

static void parse_sizes(uint64_t *sizes, int *n, const char *list) {
    char *copy = strdup(list), *save = NULL;
    *n = 0;
    for (char *t = strtok_r(copy, ",", &save); t; t = strtok_r(NULL, ",", &save)) {
        if (*n == MAX_SIZES) die("too many sizes (max %d)", MAX_SIZES);
        sizes[(*n)++] = parse_size(t);
    }
    free(copy);
}

static void parse_opts(struct opts *o, int argc, char **argv) {
    static const struct option longs[] = {
        {"provider", 1, 0, 'p'}, {"domain", 1, 0, 'd'},       {"listen", 1, 0, 'l'},
        {"connect", 1, 0, 'c'},  {"sizes", 1, 0, 's'},        {"window", 1, 0, 'w'},
        {"reps", 1, 0, 'r'},     {"bytes-per-rep", 1, 0, 'b'}, {"op-size", 1, 0, 'o'},
        {"op-window", 1, 0, 'W'}, {"ops", 1, 0, 'n'},         {"iters", 1, 0, 'i'},
        {"warmup-iters", 1, 0, 'u'}, {"buffer-size", 1, 0, 'B'}, {"timeout", 1, 0, 't'},
        {"read-sizes", 1, 0, 'R'}, {0, 0, 0, 0}};
    *o = (struct opts){.provider = "tcp", .listen = "127.0.0.1:18516", .window = 16, .reps = 5,
                       .bytes_per_rep = 512ull << 20, .op_size = 64, .op_window = 64,
                       .ops = 200000, .iters = 10000, .warmup_iters = 1000,
                       .buffer_size = 64ull << 20, .timeout = 60};
    parse_sizes(o->sizes, &o->nsizes, "4K,16K,64K,256K,1M,4M,16M,64M");
    int c;
    while ((c = getopt_long(argc, argv, "", longs, NULL)) != -1) {
        switch (c) {
        case 'p': o->provider = optarg; break;
        case 'd': o->domain = optarg; break;
        case 'l': o->listen = optarg; break;
        case 'c': o->connect = optarg; break;
        case 's':
            parse_sizes(o->sizes, &o->nsizes, optarg);
            if (!o->nsizes) die("--sizes is empty");
            break;
        case 'R': parse_sizes(o->read_sizes, &o->nread_sizes, optarg); break;
        case 'w': o->window = parse_size(optarg); break;
        case 'r': o->reps = parse_size(optarg); break;
        case 'b': o->bytes_per_rep = parse_size(optarg); break;
        case 'o': o->op_size = parse_size(optarg); break;
        case 'W': o->op_window = parse_size(optarg); break;
        case 'n': o->ops = parse_size(optarg); break;
        case 'i': o->iters = parse_size(optarg); break;
        case 'u': o->warmup_iters = strtoull(optarg, NULL, 10); break;
        case 'B': o->buffer_size = parse_size(optarg); break;
        case 't': o->timeout = (double)parse_size(optarg); break;
        default: die("unknown option (see the header of raw_write.c)");
        }
    }
    if (!o->domain && (!strncmp(o->provider, "tcp", 3) || !strncmp(o->provider, "udp", 3) ||
                       !strncmp(o->provider, "sockets", 7)))
        o->domain = "lo"; /* software providers: loopback, as fabric-lib does */
}

/* ---------- libfabric resources ---------- */

struct fab {
    struct fi_info *info;
    struct fid_fabric *fabric;
    struct fid_domain *domain;
    struct fid_cq *cq;
    struct fid_av *av;
    struct fid_ep *ep;
    struct fid_mr *mr, *rx_mr;
    void *desc, *rx_desc;
    uint64_t key, remote_base;
    char *buf, *rx_buf;
    size_t len;
    int rx_cq_data;
    struct fi_context2 *tx_ctx, rx_ctx[NRECV];
    int *free_tx, nfree, ntx;
    uint64_t tx_done, imm_count[256], pongs_owed;
    int echo; /* server: answer PING with PONG */
    fi_addr_t peer;
    uint64_t peer_key, peer_base, peer_len;
    double timeout;
};

static void post_recv(struct fab *f, int i) {
    int ret;
    while ((ret = (int)fi_recv(f->ep, f->rx_buf + 64 * i, 64, f->rx_desc, FI_ADDR_UNSPEC,
                               &f->rx_ctx[i])) == -FI_EAGAIN)
        fi_cq_read(f->cq, NULL, 0); /* drive progress, then retry */
    if (ret) die("fi_recv: %s", fi_strerror(-ret));
}

static void reg(struct fab *f, void *buf, size_t len, uint64_t req_key, struct fid_mr **mr) {
    uint64_t access = FI_READ | FI_WRITE | FI_REMOTE_READ | FI_REMOTE_WRITE | FI_SEND | FI_RECV;
    CHECK(fi_mr_reg(f->domain, buf, len, access, 0, req_key, 0, mr, NULL));
    if (f->info->domain_attr->mr_mode & FI_MR_ENDPOINT) {
        CHECK(fi_mr_bind(*mr, &f->ep->fid, 0));
        CHECK(fi_mr_enable(*mr));
    }
}

static void fab_open(struct fab *f, const struct opts *o, size_t len, int ntx) {
    struct fi_info *hints = fi_allocinfo(), *list = NULL, *pick = NULL;
    if (!hints) die("fi_allocinfo failed");
    hints->caps = FI_MSG | FI_RMA;
    hints->mode = FI_CONTEXT | FI_CONTEXT2 | FI_RX_CQ_DATA;
    hints->ep_attr->type = FI_EP_RDM;
    hints->domain_attr->mr_mode = FI_MR_LOCAL | FI_MR_VIRT_ADDR | FI_MR_ALLOCATED |
                                  FI_MR_PROV_KEY | FI_MR_ENDPOINT;
    hints->domain_attr->threading = FI_THREAD_DOMAIN;
    hints->fabric_attr->prov_name = strdup(o->provider);
    int ret = fi_getinfo(FI_VERSION(1, 17), NULL, NULL, 0, hints, &list);
    if (ret) die("no provider '%s' with RDM + RMA + MSG: %s", o->provider, fi_strerror(-ret));
    for (struct fi_info *i = list; i && !pick; i = i->next)
        if (i->domain_attr->cq_data_size >= 4 && (!o->domain || !strcmp(i->domain_attr->name, o->domain)))
            pick = i;
    if (!pick) die("provider '%s' has no domain '%s' with 4-byte CQ data", o->provider, o->domain ? o->domain : "");
    f->info = fi_dupinfo(pick);
    fi_freeinfo(list);
    fi_freeinfo(hints);

    CHECK(fi_fabric(f->info->fabric_attr, &f->fabric, NULL));
    CHECK(fi_domain(f->fabric, f->info, &f->domain, NULL));
    struct fi_cq_attr cq_attr = {.size = f->info->tx_attr->size + f->info->rx_attr->size,
                                 .format = FI_CQ_FORMAT_DATA, .wait_obj = FI_WAIT_NONE};
    CHECK(fi_cq_open(f->domain, &cq_attr, &f->cq, NULL));
    struct fi_av_attr av_attr = {.type = FI_AV_TABLE};
    CHECK(fi_av_open(f->domain, &av_attr, &f->av, NULL));
    CHECK(fi_endpoint(f->domain, f->info, &f->ep, NULL));
    CHECK(fi_ep_bind(f->ep, &f->cq->fid, FI_TRANSMIT | FI_RECV));
    CHECK(fi_ep_bind(f->ep, &f->av->fid, 0));
    CHECK(fi_enable(f->ep));

    f->len = len;
    if (posix_memalign((void **)&f->buf, 4096, len) || posix_memalign((void **)&f->rx_buf, 4096, 64 * NRECV))
        die("cannot allocate %zu bytes", len);
    memset(f->buf, 0x5a, len); /* touch every page before measuring */
    reg(f, f->buf, len, 1, &f->mr);
    reg(f, f->rx_buf, 64 * NRECV, 2, &f->rx_mr);
    f->desc = fi_mr_desc(f->mr); /* needed with FI_MR_LOCAL; harmless otherwise */
    f->rx_desc = fi_mr_desc(f->rx_mr);
    f->key = fi_mr_key(f->mr);
    if (f->key == FI_KEY_NOTAVAIL) die("fi_mr_key: key not available");
    f->remote_base = (f->info->domain_attr->mr_mode & FI_MR_VIRT_ADDR) ? (uint64_t)(uintptr_t)f->buf : 0;

    f->ntx = ntx;
    f->tx_ctx = calloc(ntx, sizeof *f->tx_ctx);
    f->free_tx = calloc(ntx, sizeof *f->free_tx);
    for (int i = 0; i < ntx; i++) f->free_tx[f->nfree++] = i;
    f->rx_cq_data = (f->info->mode & FI_RX_CQ_DATA) != 0;
    if (f->rx_cq_data)
        for (int i = 0; i < NRECV; i++) post_recv(f, i);
}

/* Posts one writedata; -FI_EAGAIN when out of contexts or the provider is full. */
static int post_write(struct fab *f, const void *buf, size_t len, uint32_t imm, uint64_t raddr) {
    if (!f->nfree) return -FI_EAGAIN;
    int slot = f->free_tx[--f->nfree];
    int ret = (int)fi_writedata(f->ep, buf, len, f->desc, imm, f->peer, raddr, f->peer_key, &f->tx_ctx[slot]);
    if (ret) {
        f->free_tx[f->nfree++] = slot;
        if (ret != -FI_EAGAIN) die("fi_writedata: %s", fi_strerror(-ret));
    }
    return ret;
}

/* Posts one read of the peer's buffer into `buf`; -FI_EAGAIN as for post_write. */
static int post_read(struct fab *f, void *buf, size_t len, uint64_t raddr) {
    if (!f->nfree) return -FI_EAGAIN;
    int slot = f->free_tx[--f->nfree];
    int ret = (int)fi_read(f->ep, buf, len, f->desc, f->peer, raddr, f->peer_key, &f->tx_ctx[slot]);
    if (ret) {
        f->free_tx[f->nfree++] = slot;
        if (ret != -FI_EAGAIN) die("fi_read: %s", fi_strerror(-ret));
    }
    return ret;
}

/* Reads completions (this is what drives progress); returns how many. */
static int progress(struct fab *f) {
    struct fi_cq_data_entry e[CQ_BATCH];
    ssize_t n = fi_cq_read(f->cq, e, CQ_BATCH);
    if (n == -FI_EAGAIN) n = 0;
    if (n == -FI_EAVAIL) {
        struct fi_cq_err_entry err = {0};
        fi_cq_readerr(f->cq, &err, 0);
        die("completion error: %s (%s)", fi_strerror(err.err),
            fi_cq_strerror(f->cq, err.prov_errno, err.err_data, NULL, 0));
    }
    if (n < 0) die("fi_cq_read: %s", fi_strerror((int)-n));
    for (ssize_t i = 0; i < n; i++) {
        struct fi_context2 *ctx = e[i].op_context;
        if (e[i].flags & FI_REMOTE_CQ_DATA) {
            uint32_t imm = (uint32_t)e[i].data;
            f->imm_count[imm & 0xff]++;
            if (f->echo && imm == IMM_PING) f->pongs_owed++;
            if (f->rx_cq_data && ctx >= f->rx_ctx && ctx < f->rx_ctx + NRECV) post_recv(f, (int)(ctx - f->rx_ctx));
        } else if (ctx >= f->tx_ctx && ctx < f->tx_ctx + f->ntx) {
            f->free_tx[f->nfree++] = (int)(ctx - f->tx_ctx);
            f->tx_done++;
        } else if (ctx >= f->rx_ctx && ctx < f->rx_ctx + NRECV) {
            post_recv(f, (int)(ctx - f->rx_ctx)); /* a message we do not use */
        }
    }
    while (f->pongs_owed && post_write(f, f->buf, 0, IMM_PONG, f->peer_base) == 0) f->pongs_owed--;
    return (int)n;
}

/* ---------- bootstrap socket ---------- */

static void put_all(int fd, const void *p, size_t n) {
    for (const char *c = p; n;) {
        ssize_t w = send(fd, c, n, MSG_NOSIGNAL);
        if (w <= 0) die("bootstrap send: %s", w ? strerror(errno) : "closed");
        c += w, n -= (size_t)w;
    }
}

static void get_all(int fd, void *p, size_t n) {
    for (char *c = p; n;) {
        ssize_t r = recv(fd, c, n, 0);
        if (r == 0) die("bootstrap peer closed the connection");
        if (r < 0) die("bootstrap recv: %s", errno == EAGAIN ? "timed out" : strerror(errno));
        c += r, n -= (size_t)r;
    }
}

static void put_u64(int fd, uint64_t v) { v = htobe64(v); put_all(fd, &v, 8); }
static uint64_t get_u64(int fd) { uint64_t v; get_all(fd, &v, 8); return be64toh(v); }

static void set_timeouts(int fd, double seconds) {
    struct timeval tv = {.tv_sec = (time_t)seconds};
    setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
    setsockopt(fd, SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof tv);
}

static struct sockaddr_in parse_hostport(const char *s) {
    char host[256];
    const char *colon = strrchr(s, ':');
    if (!colon || colon == s || (size_t)(colon - s) >= sizeof host) die("bad HOST:PORT '%s'", s);
    memcpy(host, s, (size_t)(colon - s));
    host[colon - s] = 0;
    struct addrinfo hints = {.ai_family = AF_INET, .ai_socktype = SOCK_STREAM}, *res;
    if (getaddrinfo(host, colon + 1, &hints, &res)) die("cannot resolve '%s'", s);
    struct sockaddr_in a = *(struct sockaddr_in *)res->ai_addr;
    freeaddrinfo(res);
    return a;
}

/* Sends this side's (address, key, base, length); reads the peer's and inserts it. */
static void exchange(struct fab *f, int fd) {
    char name[256], peer[256];
    size_t len = sizeof name;
    CHECK(fi_getname(&f->ep->fid, name, &len));
    put_u64(fd, len);
    put_all(fd, name, len);
    put_u64(fd, f->key);
    put_u64(fd, f->remote_base);
    put_u64(fd, f->len);
    uint64_t plen = get_u64(fd);
    if (plen > sizeof peer) die("peer address of %llu bytes is too long", (unsigned long long)plen);
    get_all(fd, peer, plen);
    f->peer_key = get_u64(fd);
    f->peer_base = get_u64(fd);
    f->peer_len = get_u64(fd);
    if (fi_av_insert(f->av, peer, 1, &f->peer, 0, NULL) != 1) die("fi_av_insert rejected the peer address");
}

/* ---------- tests ---------- */

static int cmp_double(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

/* Nearest-rank percentile, as fabric-debug computes it. */
static double percentile(const double *v, size_t n, double p) {
    if (!n) return 0;
    double *s = malloc(n * sizeof *s);
    memcpy(s, v, n * sizeof *s);
    qsort(s, n, sizeof *s, cmp_double);
    size_t rank = (size_t)(p / 100.0 * (double)n + 0.999999999);
    if (rank < 1) rank = 1;
    if (rank > n) rank = n;
    double r = s[rank - 1];
    free(s);
    return r;
}

/* Counts empty polls; dies once nothing completed for f->timeout seconds. */
static void idle_poll(struct fab *f, unsigned long *empty, double *since, const char *what) {
    if (++*empty & 0xffff) return;
    if (!*since) *since = now_s();
    else if (now_s() - *since > f->timeout)
        die("no progress for %.0f s while waiting for %s (tx done %llu)", f->timeout, what, (unsigned long long)f->tx_done);
}

/* Polls until `*counter` moves past `seen`. */
static void wait_above(struct fab *f, const uint64_t *counter, uint64_t seen, const char *what) {
    unsigned long empty = 0;
    double since = 0;
    while (*counter <= seen)
        if (!progress(f)) idle_poll(f, &empty, &since, what);
}

/* `writes` writedata (or, with `read`, reads) of `size` bytes, `window` in flight; seconds from
 * first post to last completion. */
static double timed_writes(struct fab *f, uint64_t size, uint64_t writes, uint64_t window, uint32_t imm,
                           int read) {
    uint64_t src_slots = f->len / size, dst_slots = f->peer_len / size, posted = 0, base = f->tx_done;
    unsigned long empty = 0;
    double since = 0;
    if (!src_slots || !dst_slots) die("write size %llu exceeds a buffer", (unsigned long long)size);
    double t0 = now_s();
    while (f->tx_done - base < writes) {
        while (posted < writes && posted - (f->tx_done - base) < window &&
               (read ? post_read(f, f->buf + (posted % src_slots) * size, size,
                                 f->peer_base + (posted % dst_slots) * size)
                     : post_write(f, f->buf + (posted % src_slots) * size, size, imm,
                                  f->peer_base + (posted % dst_slots) * size)) == 0)
            posted++;
        if (progress(f)) empty = 0, since = 0;
        else idle_poll(f, &empty, &since, "write completions");
    }
    return now_s() - t0;
}

static uint64_t writes_for(uint64_t size, uint64_t bytes, uint64_t window) {
    uint64_t n = (bytes + size - 1) / size;
    return n > 2 * window ? n : 2 * window;
}

/* Warm-up plus `reps` timed runs; fills samples (per-rep seconds); returns writes posted. */
static uint64_t repeat(struct fab *f, uint64_t size, uint64_t writes, uint64_t window, uint64_t reps,
                       uint32_t imm, int read, double *seconds) {
    uint64_t warm = writes < window * 4 ? writes : window * 4;
    timed_writes(f, size, warm, window, imm, read);
    for (uint64_t r = 0; r < reps; r++) seconds[r] = timed_writes(f, size, writes, window, imm, read);
    return warm + writes * reps;
}

static void print_samples(const char *key, const double *v, uint64_t n) {
    printf("\"%s\":[", key);
    for (uint64_t i = 0; i < n; i++) printf("%s%.6f", i ? "," : "", v[i]);
    printf("]");
}

/* Has the server confirm `count` arrivals of `imm`, progressing while it counts. */
static void verify(struct fab *f, int fd, uint32_t imm, uint64_t count) {
    put_all(fd, "E", 1);
    put_u64(fd, imm);
    put_u64(fd, count);
    double deadline = now_s() + f->timeout;
    for (;;) {
        progress(f);
        struct pollfd p = {.fd = fd, .events = POLLIN};
        if (poll(&p, 1, 0) > 0) break;
        if (now_s() > deadline) die("the server did not confirm immediate %u within %.0f s", imm, f->timeout);
    }
    char verdict;
    get_all(fd, &verdict, 1);
    uint64_t counted = get_u64(fd);
    if (verdict != 'K') die("server counted %llu of %llu immediates %u", (unsigned long long)counted,
                            (unsigned long long)count, imm);
}

static int connect_retry(const struct opts *o) {
    struct sockaddr_in a = parse_hostport(o->connect);
    double deadline = now_s() + o->timeout;
    for (;;) {
        int fd = socket(AF_INET, SOCK_STREAM, 0);
        if (fd < 0) die("socket: %s", strerror(errno));
        if (!connect(fd, (struct sockaddr *)&a, sizeof a)) return fd;
        int e = errno;
        close(fd);
        if (e != ECONNREFUSED || now_s() > deadline) die("connecting to %s: %s", o->connect, strerror(e));
        usleep(50000);
    }
}

static int run_client(struct fab *f, const struct opts *o) {
    if (!o->connect) die("client needs --connect HOST:PORT");
    if (!o->window || !o->op_window || !o->reps || !o->ops || !o->iters) die("counts must be positive");
    uint64_t largest = o->op_size > 4096 ? o->op_size : 4096;
    for (int i = 0; i < o->nsizes; i++) largest = o->sizes[i] > largest ? o->sizes[i] : largest;
    for (int i = 0; i < o->nread_sizes; i++) largest = o->read_sizes[i] > largest ? o->read_sizes[i] : largest;
    uint64_t depth = o->window > o->op_window ? o->window : o->op_window;
    fab_open(f, o, largest, (int)depth + 16);
    int fd = connect_retry(o);
    set_timeouts(fd, o->timeout);
    exchange(f, fd);
    const char *prov = f->info->fabric_attr->prov_name, *dom = f->info->domain_attr->name;
    double *sec = calloc(o->reps, sizeof *sec), *val = calloc(o->reps, sizeof *val);

    uint64_t total = 0;
    for (int s = 0; s < o->nsizes; s++) {
        uint64_t size = o->sizes[s], writes = writes_for(size, o->bytes_per_rep, o->window);
        total += repeat(f, size, writes, o->window, o->reps, IMM_THROUGHPUT, 0, sec);
        for (uint64_t r = 0; r < o->reps; r++) val[r] = (double)(size * writes) / sec[r] / 1e9;
        double med = percentile(val, o->reps, 50);
        printf("{\"tool\":\"raw_write\",\"test\":\"throughput\",\"provider\":\"%s\",\"domain\":\"%s\","
               "\"size\":%llu,\"window\":%llu,\"writes_per_rep\":%llu,\"reps\":%llu,"
               "\"gbytes_per_s\":%.6f,\"gbits_per_s\":%.6f,", prov, dom, (unsigned long long)size,
               (unsigned long long)o->window, (unsigned long long)writes, (unsigned long long)o->reps, med, med * 8);
        print_samples("samples_gbytes_per_s", val, o->reps);
        printf("}\n");
        fflush(stdout);
    }
    verify(f, fd, IMM_THROUGHPUT, total);

    for (int s = 0; s < o->nread_sizes; s++) {
        uint64_t size = o->read_sizes[s], reads = writes_for(size, o->bytes_per_rep, o->window);
        repeat(f, size, reads, o->window, o->reps, 0, 1, sec);
        for (uint64_t r = 0; r < o->reps; r++) val[r] = (double)(size * reads) / sec[r] / 1e9;
        double med = percentile(val, o->reps, 50);
        printf("{\"tool\":\"raw_write\",\"test\":\"read_throughput\",\"provider\":\"%s\",\"domain\":\"%s\","
               "\"size\":%llu,\"window\":%llu,\"writes_per_rep\":%llu,\"reps\":%llu,"
               "\"gbytes_per_s\":%.6f,\"gbits_per_s\":%.6f,", prov, dom, (unsigned long long)size,
               (unsigned long long)o->window, (unsigned long long)reads, (unsigned long long)o->reps, med, med * 8);
        print_samples("samples_gbytes_per_s", val, o->reps);
        printf("}\n");
        fflush(stdout);
    }

    total = repeat(f, o->op_size, o->ops, o->op_window, o->reps, IMM_OP_RATE, 0, sec);
    verify(f, fd, IMM_OP_RATE, total);
    for (uint64_t r = 0; r < o->reps; r++) val[r] = (double)o->ops / sec[r] / 1e6;
    printf("{\"tool\":\"raw_write\",\"test\":\"op_rate\",\"provider\":\"%s\",\"domain\":\"%s\",\"size\":%llu,"
           "\"window\":%llu,\"writes_per_rep\":%llu,\"reps\":%llu,\"mops_per_s\":%.6f,\"verified\":true,",
           prov, dom, (unsigned long long)o->op_size, (unsigned long long)o->op_window,
           (unsigned long long)o->ops, (unsigned long long)o->reps, percentile(val, o->reps, 50));
    print_samples("samples_mops_per_s", val, o->reps);
    printf("}\n");
    fflush(stdout);

    uint64_t n = o->warmup_iters + o->iters;
    double *us = calloc(o->iters, sizeof *us), sum = 0;
    for (uint64_t i = 0; i < n; i++) {
        uint64_t seen = f->imm_count[IMM_PONG];
        double t0 = now_s();
        unsigned long empty = 0;
        double since = 0;
        while (post_write(f, f->buf, 0, IMM_PING, f->peer_base) == -FI_EAGAIN)
            if (!progress(f)) idle_poll(f, &empty, &since, "room to post a ping");
        wait_above(f, &f->imm_count[IMM_PONG], seen, "a pong");
        if (i >= o->warmup_iters) sum += (us[i - o->warmup_iters] = (now_s() - t0) * 1e6);
    }
    printf("{\"tool\":\"raw_write\",\"test\":\"rtt\",\"iters\":%llu,\"p50_us\":%.3f,\"p99_us\":%.3f,"
           "\"min_us\":%.3f,\"mean_us\":%.3f,\"max_us\":%.3f}\n", (unsigned long long)o->iters,
           percentile(us, o->iters, 50), percentile(us, o->iters, 99), percentile(us, o->iters, 0),
           sum / (double)o->iters, percentile(us, o->iters, 100));
    fflush(stdout);

    put_all(fd, "D", 1);
    double deadline = now_s() + f->timeout;
    for (struct pollfd p = {.fd = fd, .events = POLLIN}; poll(&p, 1, 0) <= 0;) {
        progress(f); /* let our last completions drain while the server finishes */
        if (now_s() > deadline) die("the server did not acknowledge the end of the session");
    }
    char bye;
    get_all(fd, &bye, 1);
    close(fd);
    return bye == 'B' ? 0 : 1;
}

static int run_server(struct fab *f, const struct opts *o) {
    fab_open(f, o, o->buffer_size, 256);
    f->echo = 1;
    int lfd = socket(AF_INET, SOCK_STREAM, 0), one = 1;
    struct sockaddr_in a = parse_hostport(o->listen);
    setsockopt(lfd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
    if (bind(lfd, (struct sockaddr *)&a, sizeof a) || listen(lfd, 1)) die("listening on %s: %s", o->listen, strerror(errno));
    socklen_t alen = sizeof a;
    getsockname(lfd, (struct sockaddr *)&a, &alen);
    printf("READY %s:%d provider=%s domain=%s\n", inet_ntoa(a.sin_addr), ntohs(a.sin_port),
           f->info->fabric_attr->prov_name, f->info->domain_attr->name);
    fflush(stdout);
    struct pollfd lp = {.fd = lfd, .events = POLLIN};
    if (poll(&lp, 1, 600 * 1000) <= 0) die("no client connected within 600 s");
    int fd = accept(lfd, NULL, NULL);
    if (fd < 0) die("accept: %s", strerror(errno));
    set_timeouts(fd, o->timeout);
    exchange(f, fd);

    int expecting = 0;
    uint64_t eimm = 0, ecount = 0;
    double deadline = 0, last_cmd = now_s();
    for (unsigned long it = 1;; it++) {
        progress(f);
        if (expecting && f->imm_count[eimm & 0xff] >= ecount) {
            f->imm_count[eimm & 0xff] -= ecount;
            put_all(fd, "K", 1);
            put_u64(fd, ecount);
            expecting = 0;
        } else if (expecting && !(it & 1023) && now_s() > deadline) {
            put_all(fd, "F", 1);
            put_u64(fd, f->imm_count[eimm & 0xff]);
            expecting = 0;
        }
        if (it & 255) continue;
        struct pollfd p = {.fd = fd, .events = POLLIN};
        if (poll(&p, 1, 0) <= 0) {
            if (!(it & 0xfffff) && now_s() - last_cmd > 600) die("no command from the client for 600 s");
            continue;
        }
        char cmd;
        get_all(fd, &cmd, 1);
        last_cmd = now_s();
        if (cmd == 'E') {
            eimm = get_u64(fd);
            ecount = get_u64(fd);
            expecting = 1;
            deadline = now_s() + f->timeout;
        } else if (cmd == 'D') {
            put_all(fd, "B", 1);
            fprintf(stderr, "raw_write server: session done\n");
            return 0;
        } else {
            die("unknown command 0x%02x from the client", (unsigned char)cmd);
        }
    }
}

int main(int argc, char **argv) {
    if (argc < 2 || (strcmp(argv[1], "server") && strcmp(argv[1], "client")))
        die("usage: raw_write server|client [options] (see the header of raw_write.c)");
    int server = !strcmp(argv[1], "server");
    struct opts o;
    parse_opts(&o, argc - 1, argv + 1);
    struct fab f = {.timeout = o.timeout};
    return server ? run_server(&f, &o) : run_client(&f, &o);
}
