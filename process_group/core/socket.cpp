// Non-blocking TCP helpers; see socket.hpp for the -errno contract.
#include "process_group/core/socket.hpp"

#include <arpa/inet.h>
#include <fcntl.h>
#include <ifaddrs.h>
#include <net/if.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

namespace zeroplus::pg::detail {

void closeFd(int& fd) {
  if (fd >= 0) {
    ::close(fd);
    fd = -1;
  }
}

static int resolve(const std::string& host, uint16_t port, int flags, sockaddr_storage* out, socklen_t* len) {
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  hints.ai_flags = flags;
  addrinfo* res = nullptr;
  const std::string service = std::to_string(port);
  const int rc = ::getaddrinfo(host.empty() ? nullptr : host.c_str(), service.c_str(), &hints, &res);
  if (rc != 0 || res == nullptr) return -EHOSTUNREACH;
  // Prefer IPv4: loopback set-ups and most clusters publish IPv4 addresses.
  const addrinfo* pick = res;
  for (const addrinfo* it = res; it != nullptr; it = it->ai_next) {
    if (it->ai_family == AF_INET) {
      pick = it;
      break;
    }
  }
  std::memcpy(out, pick->ai_addr, pick->ai_addrlen);
  *len = pick->ai_addrlen;
  ::freeaddrinfo(res);
  return 0;
}

int listenTcp(const std::string& bindAddress, int backlog, uint16_t* port) {
  sockaddr_storage addr{};
  socklen_t len = 0;
  if (bindAddress.empty()) {
    auto* in = reinterpret_cast<sockaddr_in*>(&addr);
    in->sin_family = AF_INET;
    in->sin_addr.s_addr = htonl(INADDR_ANY);
    in->sin_port = 0;
    len = sizeof(sockaddr_in);
  } else if (int rc = resolve(bindAddress, 0, AI_PASSIVE, &addr, &len); rc < 0) {
    return rc;
  }
  int fd = ::socket(addr.ss_family, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
  if (fd < 0) return -errno;
  const int one = 1;
  ::setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
  if (::bind(fd, reinterpret_cast<sockaddr*>(&addr), len) < 0 || ::listen(fd, backlog) < 0) {
    const int err = -errno;
    closeFd(fd);
    return err;
  }
  sockaddr_storage bound{};
  socklen_t boundLen = sizeof(bound);
  if (::getsockname(fd, reinterpret_cast<sockaddr*>(&bound), &boundLen) < 0) {
    const int err = -errno;
    closeFd(fd);
    return err;
  }
  *port = ntohs(bound.ss_family == AF_INET ? reinterpret_cast<sockaddr_in*>(&bound)->sin_port
                                           : reinterpret_cast<sockaddr_in6*>(&bound)->sin6_port);
  return fd;
}

int startConnect(const std::string& host, uint16_t port) {
  sockaddr_storage addr{};
  socklen_t len = 0;
  if (int rc = resolve(host, port, 0, &addr, &len); rc < 0) return rc;
  int fd = ::socket(addr.ss_family, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
  if (fd < 0) return -errno;
  if (::connect(fd, reinterpret_cast<sockaddr*>(&addr), len) < 0 && errno != EINPROGRESS) {
    const int err = -errno;
    closeFd(fd);
    return err;
  }
  return fd;
}

int finishConnect(int fd) {
  int err = 0;
  socklen_t len = sizeof(err);
  if (::getsockopt(fd, SOL_SOCKET, SO_ERROR, &err, &len) < 0) return -errno;
  return -err;
}

int acceptTcp(int listenFd) {
  for (;;) {
    const int fd = ::accept4(listenFd, nullptr, nullptr, SOCK_NONBLOCK | SOCK_CLOEXEC);
    if (fd >= 0) return fd;
    if (errno == EINTR) continue;
    return errno == EWOULDBLOCK ? -EAGAIN : -errno;
  }
}

int tuneSocket(int fd, int bufferBytes) {
  const int one = 1;
  if (::setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one)) < 0) return -errno;
  if (bufferBytes > 0) {
    // Setting a size disables the kernel's autotuning for this socket, so it is only done on
    // request; net.core.{w,r}mem_max caps the value silently.
    ::setsockopt(fd, SOL_SOCKET, SO_SNDBUF, &bufferBytes, sizeof(bufferBytes));
    ::setsockopt(fd, SOL_SOCKET, SO_RCVBUF, &bufferBytes, sizeof(bufferBytes));
  }
  return 0;
}

long sendv(int fd, const struct iovec* iov, int iovcnt) {
  msghdr msg{};
  msg.msg_iov = const_cast<struct iovec*>(iov);
  msg.msg_iovlen = static_cast<size_t>(iovcnt);
  for (;;) {
    const ssize_t n = ::sendmsg(fd, &msg, MSG_NOSIGNAL | MSG_DONTWAIT);
    if (n >= 0) return n;
    if (errno == EINTR) continue;
    return errno == EWOULDBLOCK ? -EAGAIN : -errno;
  }
}

long recvv(int fd, struct iovec* iov, int iovcnt) {
  msghdr msg{};
  msg.msg_iov = iov;
  msg.msg_iovlen = static_cast<size_t>(iovcnt);
  for (;;) {
    const ssize_t n = ::recvmsg(fd, &msg, MSG_DONTWAIT);
    if (n >= 0) return n;
    if (errno == EINTR) continue;
    return errno == EWOULDBLOCK ? -EAGAIN : -errno;
  }
}

static int waitFd(int fd, short events, int timeoutMs) {
  pollfd p{fd, events, 0};
  for (;;) {
    const int rc = ::poll(&p, 1, timeoutMs);
    if (rc > 0) return 0;
    if (rc == 0) return -ETIMEDOUT;
    if (errno != EINTR) return -errno;
  }
}

int writeAll(int fd, const void* data, size_t n, int timeoutMs) {
  const char* p = static_cast<const char*>(data);
  while (n > 0) {
    iovec iov{const_cast<char*>(p), n};
    const long rc = sendv(fd, &iov, 1);
    if (rc == -EAGAIN) {
      if (int w = waitFd(fd, POLLOUT, timeoutMs); w < 0) return w;
      continue;
    }
    if (rc < 0) return static_cast<int>(rc);
    p += rc;
    n -= static_cast<size_t>(rc);
  }
  return 0;
}

int readAll(int fd, void* data, size_t n, int timeoutMs) {
  char* p = static_cast<char*>(data);
  while (n > 0) {
    iovec iov{p, n};
    const long rc = recvv(fd, &iov, 1);
    if (rc == -EAGAIN) {
      if (int w = waitFd(fd, POLLIN, timeoutMs); w < 0) return w;
      continue;
    }
    if (rc == 0) return -ECONNRESET;
    if (rc < 0) return static_cast<int>(rc);
    p += rc;
    n -= static_cast<size_t>(rc);
  }
  return 0;
}

std::string hostName() {
  char buf[256] = {};
  if (::gethostname(buf, sizeof(buf) - 1) < 0) return "localhost";
  return buf;
}

std::string resolveHostAddress(const std::string& host) {
  sockaddr_storage addr{};
  socklen_t len = 0;
  if (resolve(host, 0, 0, &addr, &len) < 0) return host;
  char text[INET6_ADDRSTRLEN] = {};
  const void* src = addr.ss_family == AF_INET
                        ? static_cast<const void*>(&reinterpret_cast<sockaddr_in*>(&addr)->sin_addr)
                        : static_cast<const void*>(&reinterpret_cast<sockaddr_in6*>(&addr)->sin6_addr);
  if (::inet_ntop(addr.ss_family, src, text, sizeof(text)) == nullptr) return host;
  return text;
}

int interfaceAddress(const std::string& ifname, std::string* out) {
  ifaddrs* list = nullptr;
  if (::getifaddrs(&list) != 0) return -errno;
  std::string others;
  int rc = -ENODEV;
  for (const ifaddrs* it = list; it != nullptr; it = it->ifa_next) {
    if (it->ifa_addr == nullptr || it->ifa_addr->sa_family != AF_INET) continue;
    char text[INET_ADDRSTRLEN] = {};
    ::inet_ntop(AF_INET, &reinterpret_cast<const sockaddr_in*>(it->ifa_addr)->sin_addr, text, sizeof(text));
    if (ifname == it->ifa_name) {
      *out = text;
      rc = 0;
      break;
    }
    others += (others.empty() ? "" : ", ") + std::string(it->ifa_name) + " (" + text + ")";
  }
  ::freeifaddrs(list);
  if (rc < 0) *out = others;
  return rc;
}

int defaultInterfaceAddress(std::string* out) {
  ifaddrs* list = nullptr;
  if (::getifaddrs(&list) != 0) return -errno;
  int rc = -ENODEV;
  for (const ifaddrs* it = list; it != nullptr; it = it->ifa_next) {
    if (it->ifa_addr == nullptr || it->ifa_addr->sa_family != AF_INET) continue;
    if ((it->ifa_flags & IFF_UP) == 0 || (it->ifa_flags & IFF_LOOPBACK) != 0) continue;
    char text[INET_ADDRSTRLEN] = {};
    ::inet_ntop(AF_INET, &reinterpret_cast<const sockaddr_in*>(it->ifa_addr)->sin_addr, text, sizeof(text));
    *out = text;
    rc = 0;
    break;
  }
  ::freeifaddrs(list);
  return rc;
}

bool isLoopbackAddress(const std::string& addr) {
  in_addr a{};
  return ::inet_pton(AF_INET, addr.c_str(), &a) == 1 && (ntohl(a.s_addr) >> 24) == 127;
}

std::string errnoString(int negErrno) { return std::strerror(negErrno < 0 ? -negErrno : negErrno); }

}  // namespace zeroplus::pg::detail
