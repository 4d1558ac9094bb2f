"""The program inside the code sandbox: limit this process, then run the tests.

Started by ``seamlessflow.rewards.sandbox`` as ``python -I -S sandbox_harness.py FD`` in
a fresh working directory, so it imports the standard library only (``-S``: no
site-packages). Protocol:
- stdin: one JSON job ``{"nonce", "solution", "setup", "tests", "limits"}``, read in
  full and then replaced by /dev/null, so the untrusted code reads an empty stdin;
- FD (inherited, an open file): one line per result, ``<nonce> <key> <outcome>``, where
  key is ``seccomp`` (outcome ``on``/``off``), ``solution`` (the exception that stopped
  the solution or setup code: ``fail <ExceptionName>``) or a test's index (``pass`` or
  ``fail <ExceptionName>``), written as each test finishes.

Order matters: limits and the seccomp filter are in place before the first line of
untrusted code runs. They are set here rather than in a ``preexec_fn``, which is unsafe
in a caller with threads (the services have some). The solution runs once
(``__name__ == "solution"``, so its ``if __name__ == "__main__"`` block does not), then
the setup code, then each test in the same namespace; an exception (``SystemExit``
included) fails that test only.

The nonce is why exiting early (``sys.exit(0)``, ``os._exit(0)``) or printing a fake
result line earns nothing: only lines with the nonce count, and the untrusted code is
never given it. Names the harness calls after the untrusted code starts are bound
here at import, so patching ``builtins`` or ``os`` does not reach them. This stops the
easy routes, not code that deliberately inspects this process's memory or frames to
find the nonce (see the limits in ``seamlessflow.rewards.sandbox``).
"""

from __future__ import annotations

import ctypes
import errno
import json
import os
import resource
import signal
import struct
import sys

# Bound before any untrusted code runs: patching ``builtins`` or ``os`` later does not
# reach the harness's own calls.
_compile, _exec, _enumerate, _type, _write = compile, exec, enumerate, type, os.write

# x86-64 system calls the untrusted code may not make (asm/unistd_64.h): they create
# processes or threads, open sockets (io_uring could do networking past a socket filter),
# signal or trace other processes, or administer the machine. A denylist, not an
# allowlist: Python's own start-up and file I/O need a long tail of calls.
DENIED_SYSCALLS_X86_64: dict[str, int] = {
    "socket": 41, "socketpair": 53, "clone": 56, "fork": 57, "vfork": 58, "execve": 59,
    "kill": 62, "ptrace": 101, "pivot_root": 155, "chroot": 161, "mount": 165,
    "umount2": 166, "swapon": 167, "swapoff": 168, "reboot": 169, "init_module": 175,
    "delete_module": 176, "tkill": 200, "tgkill": 234, "kexec_load": 246, "add_key": 248,
    "request_key": 249, "keyctl": 250, "unshare": 272, "perf_event_open": 298,
    "setns": 308, "process_vm_readv": 310, "process_vm_writev": 311, "finit_module": 313,
    "kexec_file_load": 320, "bpf": 321, "execveat": 322, "userfaultfd": 323,
    "pidfd_send_signal": 424, "io_uring_setup": 425, "open_tree": 428, "move_mount": 429,
    "fsopen": 430, "fsconfig": 431, "fsmount": 432, "clone3": 435,
}  # fmt: skip
MAX_OPEN_FILES = 64

_PR_SET_NO_NEW_PRIVS = 38
_PR_SET_SECCOMP = 22
_SECCOMP_MODE_FILTER = 2
_AUDIT_ARCH_X86_64 = 0xC000003E
_X32_SYSCALL_BIT = 0x40000000
_BPF_LD_W_ABS = 0x20  # BPF_LD | BPF_W | BPF_ABS
_BPF_JEQ_K = 0x15  # BPF_JMP | BPF_JEQ | BPF_K
_BPF_JGE_K = 0x35  # BPF_JMP | BPF_JGE | BPF_K
_BPF_RET_K = 0x06  # BPF_RET | BPF_K
_SECCOMP_RET_ALLOW = 0x7FFF0000
_SECCOMP_RET_KILL_PROCESS = 0x80000000
_SECCOMP_RET_ERRNO = 0x00050000
_OFFSET_NR, _OFFSET_ARCH = 0, 4  # in struct seccomp_data


class _SockFprog(ctypes.Structure):
    _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_void_p)]


def _instruction(code: int, k: int, jump_true: int = 0, jump_false: int = 0) -> bytes:
    return struct.pack("HBBI", code, jump_true, jump_false, k)


def seccomp_program(denied: list[int]) -> bytes:
    """A classic-BPF filter: other architectures (32-bit calls from this process) are
    killed, x32-ABI numbers and the denied calls fail with EPERM, the rest are allowed.

    Layout: [0] load arch, [1] arch ok?, [2] kill, [3] load nr, [4] x32?,
    [5 .. 5+n) one test per denied call, [5+n] allow, [6+n] EPERM. A jump offset counts
    the instructions skipped after the jump itself.
    """
    n = len(denied)
    program = [
        _instruction(_BPF_LD_W_ABS, _OFFSET_ARCH),
        _instruction(_BPF_JEQ_K, _AUDIT_ARCH_X86_64, jump_true=1),
        _instruction(_BPF_RET_K, _SECCOMP_RET_KILL_PROCESS),
        _instruction(_BPF_LD_W_ABS, _OFFSET_NR),
        _instruction(_BPF_JGE_K, _X32_SYSCALL_BIT, jump_true=n + 1),
    ]
    program += [_instruction(_BPF_JEQ_K, nr, jump_true=n - i) for i, nr in enumerate(denied)]
    program += [
        _instruction(_BPF_RET_K, _SECCOMP_RET_ALLOW),
        _instruction(_BPF_RET_K, _SECCOMP_RET_ERRNO | errno.EPERM),
    ]
    return b"".join(program)


def install_seccomp() -> bool:
    """Deny ``DENIED_SYSCALLS_X86_64`` to this process for good; False where it cannot
    (not Linux on x86-64, or a kernel without seccomp filters)."""
    if sys.platform != "linux" or os.uname().machine != "x86_64":
        return False
    code = seccomp_program(list(DENIED_SYSCALLS_X86_64.values()))
    program = ctypes.create_string_buffer(code, len(code))
    fprog = _SockFprog(len(code) // 8, ctypes.cast(program, ctypes.c_void_p))
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(_PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0:
        return False
    return libc.prctl(_PR_SET_SECCOMP, _SECCOMP_MODE_FILTER, ctypes.byref(fprog), 0, 0) == 0


def _lower_limit(which: int, soft: int, hard: int | None = None) -> None:
    """Set a limit (hard = soft unless given), never above the hard limit inherited."""
    _, inherited = resource.getrlimit(which)
    hard = soft if hard is None else hard
    if inherited != resource.RLIM_INFINITY:
        soft, hard = min(soft, inherited), min(hard, inherited)
    resource.setrlimit(which, (soft, hard))


def apply_limits(limits: dict[str, int]) -> None:
    """Resource limits, inherited by nothing (no process can be created) and permanent
    (lowering a hard limit cannot be undone without privileges)."""
    _lower_limit(resource.RLIMIT_CORE, 0)
    _lower_limit(resource.RLIMIT_AS, limits["memory_bytes"])
    _lower_limit(resource.RLIMIT_FSIZE, limits["file_size_bytes"])
    _lower_limit(resource.RLIMIT_NOFILE, MAX_OPEN_FILES)
    _lower_limit(resource.RLIMIT_NPROC, 0)  # effective for non-root users only
    # CPU: SIGXCPU at the soft limit, SIGKILL one second later at the hard limit.
    _lower_limit(resource.RLIMIT_CPU, limits["cpu_s"], limits["cpu_s"] + 1)
    # A write past RLIMIT_FSIZE then fails with EFBIG instead of killing the process.
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)


class Reporter:
    def __init__(self, fd: int, nonce: str) -> None:
        self.fd = fd
        self.nonce = nonce

    def line(self, key: str, outcome: str) -> None:
        _write(self.fd, f"{self.nonce} {key} {outcome}\n".encode())


def failure(error: BaseException) -> str:
    name = " ".join(_type(error).__name__.split())  # one line, whatever the class says
    return f"fail {name}"


def run_job(job: dict, report: Reporter) -> None:
    namespace: dict = {"__name__": "solution"}
    try:
        _exec(_compile(job["solution"], "solution.py", "exec"), namespace)
        _exec(_compile(job["setup"], "setup.py", "exec"), namespace)
    except BaseException as error:  # the untrusted code may raise anything, SystemExit too
        report.line("solution", failure(error))
        return
    for index, test in _enumerate(job["tests"]):
        try:
            _exec(_compile(test, f"test_{index}.py", "exec"), namespace)
        except BaseException as error:
            report.line(f"{index}", failure(error))
        else:
            report.line(f"{index}", "pass")


def main() -> None:
    results_fd = int(sys.argv[1])
    job = json.loads(sys.stdin.buffer.read())
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    os.close(devnull)
    apply_limits(job["limits"])
    report = Reporter(results_fd, job.pop("nonce"))
    report.line("seccomp", "on" if install_seccomp() else "off")
    run_job(job, report)


if __name__ == "__main__":
    main()
