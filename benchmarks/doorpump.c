/* A simulated host's door client (benchmarks/simkept.py): what the ssh
 * client is on the controller's machine for a real host's door, at the cost
 * of an ssh client through a shared connection, not of an interpreter.
 * Connects stdin and stdout to the Unix socket argv[1] and pumps both ways
 * until either side ends (as keptagent._pump does). */
#include <poll.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

static int write_all(int fd, const char *buf, ssize_t n) {
    while (n > 0) {
        ssize_t w = write(fd, buf, (size_t)n);
        if (w <= 0) return -1;
        buf += w;
        n -= w;
    }
    return 0;
}

int main(int argc, char **argv) {
    if (argc != 2) return 2;
    struct sockaddr_un addr;
    memset(&addr, 0, sizeof addr);
    addr.sun_family = AF_UNIX;
    strncpy(addr.sun_path, argv[1], sizeof addr.sun_path - 1);
    int sock = socket(AF_UNIX, SOCK_STREAM, 0);
    if (sock < 0 || connect(sock, (struct sockaddr *)&addr, sizeof addr) < 0) return 1;
    struct pollfd fds[2] = {{0, POLLIN, 0}, {sock, POLLIN, 0}};
    static char buf[1 << 16];
    for (;;) {
        if (poll(fds, 2, -1) < 0) return 1;
        if (fds[0].revents) {
            ssize_t n = read(0, buf, sizeof buf);
            if (n <= 0 || write_all(sock, buf, n) < 0) break; /* the controller let go */
        }
        if (fds[1].revents) {
            ssize_t n = read(sock, buf, sizeof buf);
            if (n <= 0 || write_all(1, buf, n) < 0) break;
        }
    }
    close(sock);
    return 0;
}
