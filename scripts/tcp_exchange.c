/* The floor under a 2-rank allreduce over loopback TCP: two processes, one connection, each
 * sends BYTES to the other while it receives BYTES from it (what a 2-rank ring allreduce moves:
 * half its buffer each way in the reduce-scatter, half in the allgather), one thread each,
 * non-blocking sockets and poll(2), 512 KiB per call, no reduction and no copy besides the
 * kernel's. scripts/side_by_side.py builds and runs it next to `cohort bench`.
 *
 *     cc -O2 -o tcp_exchange scripts/tcp_exchange.c
 *     ./tcp_exchange BYTES ITERS WARMUP   # prints the mean µs per iteration (of one process)
 */
#include <arpa/inet.h>
#include <errno.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#define CHUNK (512 * 1024)

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + t.tv_nsec * 1e-9;
}

static void die(const char *what) {
    perror(what);
    exit(1);
}

/* Send and receive `n` bytes at once on non-blocking `fd`. */
static void exchange(int fd, const char *out, char *in, size_t n) {
    size_t sent = 0, got = 0;
    while (sent < n || got < n) {
        struct pollfd p = {fd, (short)((sent < n ? POLLOUT : 0) | (got < n ? POLLIN : 0)), 0};
        if (poll(&p, 1, -1) < 0 && errno != EINTR) die("poll");
        if (p.revents & (POLLERR | POLLHUP)) {
            fprintf(stderr, "tcp_exchange: the peer closed the connection\n");
            exit(1);
        }
        while (got < n) {
            size_t want = n - got < CHUNK ? n - got : CHUNK;
            ssize_t r = recv(fd, in, want, 0);
            if (r == 0) {
                fprintf(stderr, "tcp_exchange: EOF from the peer\n");
                exit(1);
            }
            if (r < 0) {
                if (errno == EAGAIN || errno == EINTR) break;
                die("recv");
            }
            got += (size_t)r;
        }
        while (sent < n) {
            size_t w = n - sent < CHUNK ? n - sent : CHUNK;
            ssize_t r = send(fd, out + sent, w, 0);
            if (r < 0) {
                if (errno == EAGAIN || errno == EINTR) break;
                die("send");
            }
            sent += (size_t)r;
        }
    }
}

int main(int argc, char **argv) {
    if (argc != 4) {
        fprintf(stderr, "usage: %s BYTES ITERS WARMUP\n", argv[0]);
        return 2;
    }
    size_t n = strtoull(argv[1], NULL, 10);
    int iters = atoi(argv[2]), warmup = atoi(argv[3]);
    if (n == 0 || iters <= 0 || warmup < 0) {
        fprintf(stderr, "tcp_exchange: BYTES and ITERS must be positive, WARMUP not negative\n");
        return 2;
    }
    int ls = socket(AF_INET, SOCK_STREAM, 0);
    struct sockaddr_in a;
    memset(&a, 0, sizeof a);
    a.sin_family = AF_INET;
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    socklen_t al = sizeof a;
    if (ls < 0 || bind(ls, (void *)&a, sizeof a) || listen(ls, 1) || getsockname(ls, (void *)&a, &al)) die("listen");
    pid_t pid = fork();
    if (pid < 0) die("fork");
    int fd;
    if (pid == 0) {
        fd = socket(AF_INET, SOCK_STREAM, 0);
        if (fd < 0 || connect(fd, (void *)&a, sizeof a)) die("connect");
    } else {
        fd = accept(ls, NULL, NULL);
        if (fd < 0) die("accept");
    }
    int one = 1;
    setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
    fcntl(fd, F_SETFL, O_NONBLOCK);
    char *out = malloc(n), *in = malloc(CHUNK);
    double *times = malloc(sizeof(double) * (size_t)iters);
    if (!out || !in || !times) die("malloc");
    memset(out, 1, n);
    for (int it = 0; it < warmup + iters; it++) {
        double t0 = now();
        exchange(fd, out, in, n);
        if (it >= warmup) times[it - warmup] = (now() - t0) * 1e6;
    }
    if (pid != 0) {
        int status;
        waitpid(pid, &status, 0);
        double sum = 0;
        for (int i = 0; i < iters; i++) sum += times[i];
        printf("%.1f\n", sum / iters);
        return WIFEXITED(status) ? WEXITSTATUS(status) : 1;
    }
    return 0;
}
