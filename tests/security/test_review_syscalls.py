# ruff: noqa: E501  (the C probe's lines)
"""Review of the seccomp allowlist (seccomp_filter.py) from an image build step, where the
tenant's command is root of a user namespace (uids 300000+) but shares the node's network
namespace, owned by the init user namespace.

A tenant with a deploy token of its own workspace ships a static C program in a registry
layer and runs it as a `run_commands` step. It tries, and prints what each answered:

- CAP_NET_ADMIN / CAP_NET_RAW / CAP_NET_BIND_SERVICE over the node's network namespace:
  an RTM_NEWLINK of a dummy link (deleted at once had it been made), AF_PACKET and raw
  inet sockets, a bind of 127.0.0.1:1;
- a nested user or network namespace: clone(CLONE_NEWUSER), clone(CLONE_NEWNET) with
  bits above the 32 the kernel reads, unshare, setns; mount and a char device node;
- the key calls, bpf, userfaultfd, io_uring, perf_event_open;
- the step's PID 1 (build_step_init.py, the node's root): ptrace, a signal;
- the terminal: /dev/tty (the node's device node is lent) and TIOCSTI, which would type
  into an operator's shell were the step in the agent's session (dev.tty.legacy_tiocsti
  is 1 on this kernel);
- SCHED_FIFO, nice -20, a raised RLIMIT_MEMLOCK (hurting the node's other work);
- listmount of another mount namespace by id (the node's mounts).

Only pidfd_open of its own PID 1 may answer (it can do nothing with it).
"""

from __future__ import annotations

import io
import shutil
import subprocess
import tarfile
from collections.abc import Iterator
from pathlib import Path

import pytest
from harness import Platform, running_platform
from machine_needs import need
from oci_registry import check_tools, push_layers, running_registry
from test_build_steps import _deploy, _layer, _tenant

PROBE_SOURCE = r"""
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <sched.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>
#include <dirent.h>
#include <sys/ioctl.h>
#include <sys/mount.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/sysmacros.h>
#include <sys/wait.h>
#include <termios.h>
#include <unistd.h>
#include <linux/netlink.h>
#include <linux/rtnetlink.h>
#include <linux/if_link.h>
#include <linux/if_packet.h>
#include <net/if.h>
#include <netinet/in.h>

static void say(const char *what, long r);
static long forked(long r) { if (r == 0) _exit(0); if (r > 0) waitpid(r, 0, __WALL); return r; }
static void say(const char *what, long r) {
    if (r >= 0) printf("probe %s=ok\n", what);
    else printf("probe %s=%s\n", what, strerrorname_np(errno));
    fflush(stdout);
}

/* RTM_NEWLINK of a dummy link named emberrv0 in the netns we are in: needs CAP_NET_ADMIN
   over that netns's owner. Returns the netlink answer's error (0 = made). */
static int netlink_link(int type, int flags) {
    int fd = socket(AF_NETLINK, SOCK_RAW | SOCK_CLOEXEC, NETLINK_ROUTE);
    if (fd < 0) return -errno;
    struct { struct nlmsghdr h; struct ifinfomsg i; char buf[256]; } req;
    memset(&req, 0, sizeof req);
    req.h.nlmsg_type = type;
    req.h.nlmsg_flags = NLM_F_REQUEST | NLM_F_ACK | flags;
    req.i.ifi_family = AF_UNSPEC;
    char *p = (char *)&req + NLMSG_ALIGN(sizeof req.h + sizeof req.i);
    struct rtattr *name = (struct rtattr *)p;
    name->rta_type = IFLA_IFNAME; name->rta_len = RTA_LENGTH(9);
    memcpy(RTA_DATA(name), "emberrv0", 9);
    p += RTA_ALIGN(name->rta_len);
    if (type == RTM_NEWLINK) {
        struct rtattr *info = (struct rtattr *)p;
        info->rta_type = IFLA_LINKINFO;
        struct rtattr *kind = (struct rtattr *)RTA_DATA(info);
        kind->rta_type = IFLA_INFO_KIND; kind->rta_len = RTA_LENGTH(6);
        memcpy(RTA_DATA(kind), "dummy", 6);
        info->rta_len = RTA_LENGTH(RTA_ALIGN(kind->rta_len));
        p += RTA_ALIGN(info->rta_len);
    }
    req.h.nlmsg_len = p - (char *)&req;
    if (send(fd, &req, req.h.nlmsg_len, 0) < 0) { int e = errno; close(fd); return -e; }
    char answer[4096];
    int n = recv(fd, answer, sizeof answer, 0);
    close(fd);
    if (n < 0) return -errno;
    struct nlmsghdr *h = (struct nlmsghdr *)answer;
    if (h->nlmsg_type == NLMSG_ERROR) return ((struct nlmsgerr *)NLMSG_DATA(h))->error;
    return -EPROTO;
}

struct mnt_id_req { uint32_t size, spare; uint64_t mnt_id, param, mnt_ns_id; };

int main(void) {
    int made = netlink_link(RTM_NEWLINK, NLM_F_CREATE | NLM_F_EXCL);
    printf("probe netlink new dummy link=%s\n", made == 0 ? "ok" : strerrorname_np(-made));
    if (made == 0) printf("probe cleanup=%d\n", netlink_link(RTM_DELLINK, 0));
    say("socket AF_PACKET raw", socket(AF_PACKET, SOCK_RAW, htons(0x0003)));
    say("socket AF_INET raw", socket(AF_INET, SOCK_RAW, IPPROTO_ICMP));
    int s = socket(AF_INET, SOCK_STREAM, 0);
    struct sockaddr_in low = { .sin_family = AF_INET, .sin_port = htons(1), .sin_addr = { htonl(0x7f000001) } };
    say("bind 127.0.0.1:1", bind(s, (struct sockaddr *)&low, sizeof low));
    close(s);
    say("clone NEWUSER", forked(syscall(SYS_clone, CLONE_NEWUSER | SIGCHLD, 0, 0, 0, 0)));
    say("clone NEWNET high bits", forked(syscall(SYS_clone, (1UL << 32) | CLONE_NEWNET | SIGCHLD, 0, 0, 0, 0)));
    say("unshare NEWUSER", unshare(CLONE_NEWUSER));
    say("setns", setns(0, 0));
    say("mount proc", mount("proc", "/tmp", "proc", 0, 0));
    say("mknod char 1:1", mknod("/tmp/mem", S_IFCHR | 0666, makedev(1, 1)));
    say("add_key", syscall(SYS_add_key, "user", "x", "y", 1, -4 /* user keyring */));
    say("keyctl", syscall(SYS_keyctl, 0 /* GET_KEYRING_ID */, -4, 0));
    say("bpf", syscall(SYS_bpf, 0, 0, 0));
    say("userfaultfd", syscall(SYS_userfaultfd, 0));
    say("io_uring_setup", syscall(SYS_io_uring_setup, 1, 0));
    say("perf_event_open", syscall(SYS_perf_event_open, 0, 0, -1, -1, 0));
    say("ptrace attach 1", syscall(SYS_ptrace, 16 /* ATTACH */, 1, 0, 0));
    say("kill 1 (signal 0)", kill(1, 0));
    int tty = open("/dev/tty", O_RDWR);
    say("open /dev/tty", tty);
    char c = 'x';
    say("TIOCSTI /dev/tty", tty >= 0 ? ioctl(tty, TIOCSTI, &c) : -1);
    say("TIOCSTI stdin", ioctl(0, TIOCSTI, &c));
    struct sched_param prio = { .sched_priority = 1 };
    say("sched FIFO", sched_setscheduler(0, SCHED_FIFO, &prio));
    say("nice -20", setpriority(PRIO_PROCESS, 0, -20));
    struct rlimit lim; getrlimit(RLIMIT_MEMLOCK, &lim);
    lim.rlim_max = RLIM_INFINITY; lim.rlim_cur = RLIM_INFINITY;
    say("raise memlock", setrlimit(RLIMIT_MEMLOCK, &lim));
    say("pidfd_open 1", syscall(SYS_pidfd_open, 1, 0));
    /* listmount of other mount namespaces (by id): the node's mounts if it answers. */
    uint64_t own = 0;
    int nsfd = open("/proc/self/ns/mnt", O_RDONLY);
    if (nsfd >= 0) ioctl(nsfd, 0x8008b705, &own);
    int foreign = 0, firsterr = 0;
    { struct mnt_id_req req = { .size = 32, .mnt_id = 0xffffffffffffffffULL, .mnt_ns_id = 0 };
      uint64_t ids[64]; say("listmount own", syscall(458, &req, ids, 64, 0)); }
    for (uint64_t id = 1; id < 4096; id++) {
        if (id == own) continue;
        struct mnt_id_req req = { .size = 32, .mnt_id = 0xffffffffffffffffULL, .mnt_ns_id = id };
        uint64_t ids[64];
        long n = syscall(458 /* listmount */, &req, ids, 64, 0);
        if (n > 0) { foreign++; printf("probe listmount ns %lu: %ld mounts\n", (unsigned long)id, n); }
        else if (!firsterr && n < 0 && errno != ENOENT) firsterr = errno;
    }
    printf("probe listmount foreign=%d own=%lu err=%s\n", foreign, (unsigned long)own,
           firsterr ? strerrorname_np(firsterr) : "none");
    int procs = 0;
    DIR *d = opendir("/proc");
    struct dirent *e;
    while (d && (e = readdir(d))) if (e->d_name[0] >= '0' && e->d_name[0] <= '9') procs++;
    printf("probe processes seen=%d uid=%d\n", procs, getuid());
    printf("probe-done\n");
    return 0;
}
"""

# What the kernel or the filter should answer to each probe in a build step.
EXPECTED = {
    "netlink new dummy link": "EPERM",
    "socket AF_PACKET raw": "EPERM",
    "socket AF_INET raw": "EPERM",
    "bind 127.0.0.1:1": "EACCES",
    "clone NEWUSER": "EPERM",
    "clone NEWNET high bits": "EPERM",
    "unshare NEWUSER": "EPERM",
    "setns": "EPERM",
    "mount proc": "EPERM",
    "mknod char 1:1": "EPERM",
    "add_key": "EPERM",
    "keyctl": "EPERM",
    "bpf": "EPERM",
    "userfaultfd": "EPERM",
    "io_uring_setup": "EPERM",
    "perf_event_open": "EPERM",
    "ptrace attach 1": "EPERM",
    "kill 1 (signal 0)": "EPERM",
    "open /dev/tty": "ENXIO",
    "TIOCSTI /dev/tty": "ENXIO",
    "sched FIFO": "EPERM",
    "nice -20": "EACCES",
    "raise memlock": "EPERM",
    "pidfd_open 1": "ok",
}


def _dev_layer(work: Path) -> Path:
    """A /dev with an empty tty file: where the step is lent the node's /dev/tty."""
    archive = work / "dev.tar"
    with tarfile.open(archive, "w") as tar:
        folder = tarfile.TarInfo("dev")
        folder.type, folder.mode = tarfile.DIRTYPE, 0o755
        tar.addfile(folder)
        tar.addfile(tarfile.TarInfo("dev/tty"), io.BytesIO(b""))
    return archive


@pytest.fixture(scope="module")
def platform(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Platform]:
    with running_platform(tmp_path_factory.mktemp("platform")) as running:
        yield running


def test_a_build_step_gets_nothing_over_the_node_from_its_user_namespace(
    platform: Platform, tmp_path: Path
) -> None:
    check_tools()
    if shutil.which("cc") is None:
        need("packages", "no C compiler (cc) to build the tenant's program with")
    (tmp_path / "probe.c").write_text(PROBE_SOURCE)
    program = tmp_path / "probe"
    compile_it = ["cc", "-static", "-O1", "-o", str(program), str(tmp_path / "probe.c")]
    subprocess.run(compile_it, check=True)
    layer = _layer(tmp_path, program.read_bytes(), (1, 3))
    env = _tenant(platform, "mallory")
    with running_registry(tmp_path / "registry") as registry:
        push_layers(registry, "tools/probe", "v1", [layer, _dev_layer(tmp_path)])
        base = f"ember.Image.from_registry('{registry}/tools/probe:v1')"
        image = f"{base}.run_commands('/bin/escape')"
        deployed = _deploy(env, tmp_path / "app", "probe", image)
    output = deployed.stdout + deployed.stderr
    assert "probe-done" in output, output
    seen: dict[str, str] = {}
    for line in output.splitlines():
        _, found, rest = line.partition("probe ")
        name, eq, answer = rest.rpartition("=")
        if found and eq and not rest.startswith("listmount foreign"):
            seen[name.strip()] = answer.strip()
    assert "probe cleanup" not in seen, f"the step made a link in the node's netns: {output}"
    assert {k: seen.get(k) for k in EXPECTED} == EXPECTED, output
    assert "listmount foreign=0 " in output, output
