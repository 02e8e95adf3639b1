// Internal: thin non-blocking TCP helpers. Every function returns a file descriptor / byte
// count >= 0 on success or -errno on failure (liburing style); nothing here throws. The
// communicator turns failures into CommError at its edge.
#pragma once

#include <sys/uio.h>

#include <cstddef>
#include <cstdint>
#include <string>

namespace zeroplus::pg::detail {

// Closes fd if it is >= 0 and sets it to -1.
void closeFd(int& fd);

// A listening, non-blocking TCP socket on `bindAddress` (empty: every IPv4 interface), port
// chosen by the kernel. On success stores the port in *port.
int listenTcp(const std::string& bindAddress, int backlog, uint16_t* port);

// Starts a non-blocking connect to host:port (host is a name or numeric address). Returns the
// socket (connection possibly still in progress: wait for POLLOUT, then finishConnect).
int startConnect(const std::string& host, uint16_t port);

// After POLLOUT on a connecting socket: 0 when connected, else -errno (e.g. -ECONNREFUSED).
int finishConnect(int fd);

// accept4() with SOCK_NONBLOCK | SOCK_CLOEXEC; -EAGAIN when nothing is pending.
int acceptTcp(int listenFd);

// TCP_NODELAY (collectives are latency-bound for small messages and we never write partial
// logical messages that Nagle could usefully coalesce) and, when bufferBytes > 0, SO_SNDBUF /
// SO_RCVBUF. Returns 0 or -errno.
int tuneSocket(int fd, int bufferBytes);

// sendmsg()/recvmsg() over an iovec, never raising SIGPIPE, never blocking. Returns bytes
// moved, -EAGAIN when the socket is not ready, 0 from recvv means the peer closed.
long sendv(int fd, const struct iovec* iov, int iovcnt);
long recvv(int fd, struct iovec* iov, int iovcnt);

// Reads exactly / writes exactly n bytes, polling with `timeoutMs` per wait; used only for the
// small connection handshake. Returns 0, -ETIMEDOUT or -errno (-ECONNRESET on EOF).
int writeAll(int fd, const void* data, size_t n, int timeoutMs);
int readAll(int fd, void* data, size_t n, int timeoutMs);

// This host's name, and an address for it that other hosts can use (first IPv4 result of
// resolving the name; falls back to the name itself).
std::string hostName();
std::string resolveHostAddress(const std::string& host);

// The first IPv4 address of network interface `ifname` in *out: 0, or -ENODEV (no such
// interface with an IPv4 address; *out then lists the interfaces that have one).
int interfaceAddress(const std::string& ifname, std::string* out);

// The IPv4 address of the first interface that is up and not loopback, in getifaddrs() order:
// 0, or -ENODEV when there is none. The fallback address of a host whose name does not resolve
// to a usable address (a container's made-up host name, Debian's 127.0.1.1 entry).
int defaultInterfaceAddress(std::string* out);

// True for a numeric IPv4 address in 127.0.0.0/8.
bool isLoopbackAddress(const std::string& addr);

// "Connection refused" etc. for a -errno value.
std::string errnoString(int negErrno);

}  // namespace zeroplus::pg::detail
