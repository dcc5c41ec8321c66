/* Makes a process bind its wildcard listening sockets to one address (LD_PRELOAD).

   TensorFlow's gRPC server listens on "0.0.0.0:PORT" (every interface, IPv4
   and IPv6) whatever its cluster spec names. Loaded into a server process with
   TFPIPE_BIND_HOST set to an IPv4 address, this bind() moves a wildcard
   address (0.0.0.0, or :: as its IPv4-mapped form) to that address; every
   other bind is unchanged. Built on first use by tfpipe/bind.py. */
#define _GNU_SOURCE
#include <arpa/inet.h>
#include <dlfcn.h>
#include <netinet/in.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>

typedef int (*bind_fn)(int, const struct sockaddr *, socklen_t);

int bind(int fd, const struct sockaddr *addr, socklen_t len) {
  static bind_fn real = NULL;
  if (real == NULL) real = (bind_fn)dlsym(RTLD_NEXT, "bind");
  const char *host = getenv("TFPIPE_BIND_HOST");
  struct in_addr want;
  if (host == NULL || addr == NULL || inet_pton(AF_INET, host, &want) != 1)
    return real(fd, addr, len);
  if (addr->sa_family == AF_INET && len >= (socklen_t)sizeof(struct sockaddr_in)) {
    struct sockaddr_in a;
    memcpy(&a, addr, sizeof a);
    if (a.sin_addr.s_addr == htonl(INADDR_ANY)) {
      a.sin_addr = want;
      return real(fd, (const struct sockaddr *)&a, sizeof a);
    }
  } else if (addr->sa_family == AF_INET6 && len >= (socklen_t)sizeof(struct sockaddr_in6)) {
    struct sockaddr_in6 a;
    memcpy(&a, addr, sizeof a);
    if (memcmp(&a.sin6_addr, &in6addr_any, sizeof a.sin6_addr) == 0) {
      memset(&a.sin6_addr, 0, sizeof a.sin6_addr);
      a.sin6_addr.s6_addr[10] = 0xff;
      a.sin6_addr.s6_addr[11] = 0xff;
      memcpy(&a.sin6_addr.s6_addr[12], &want, sizeof want);
      return real(fd, (const struct sockaddr *)&a, sizeof a);
    }
  }
  return real(fd, addr, len);
}
